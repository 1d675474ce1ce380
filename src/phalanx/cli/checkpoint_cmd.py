"""``phalanx checkpoint info`` and ``phalanx checkpoint export``."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from phalanx.checkpoint.export import FORMATS, export, open_checkpoint, output_format
from phalanx.checkpoint.files import describe_layout
from phalanx.cli import options
from phalanx.cli.console import console
from phalanx.util.units import format_bytes


def register(commands) -> None:
    parser = commands.add_parser("checkpoint", help="inspect a checkpoint, or export its weights as a plain state dict")
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", parser_class=type(parser), required=True)
    info = sub.add_parser(
        "info",
        help="what a checkpoint holds",
        description="Show what a phalanx checkpoint holds and check its files against the manifest.",
    )
    info.add_argument("path", help="a checkpoint directory, its parent (the latest one is used) or its 'latest' file")
    info.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 check of every file (fast for very large checkpoints)",
    )
    options.add_json(info, "the manifest as it is stored")
    info.set_defaults(run=_info)
    out = sub.add_parser(
        "export",
        help="write one model's weights as a plain state dict",
        description=(
            "Write a consolidated state dict (no 'module.' prefix, whichever strategy saved it) "
            "that loads into the bare model with model.load_state_dict(torch.load(OUT)), or, as a "
            ".safetensors file, with model.load_state_dict(safetensors.torch.load_file(OUT))."
        ),
    )
    out.add_argument("path", help="a checkpoint directory, its parent or its 'latest' file")
    out.add_argument("out", help="the .pt or .safetensors file to write")
    out.add_argument(
        "--model", type=int, default=0, metavar="N", help="which model, when the run set up several (default 0)"
    )
    out.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="the file format (default: safetensors when OUT ends in .safetensors, else pt)",
    )
    out.set_defaults(run=_export)


def _info(args: argparse.Namespace) -> int:
    manifest = open_checkpoint(args.path, verify=not args.no_verify)
    if args.json:
        print(json.dumps(manifest, indent=1))
        return 0
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    data = manifest.get("data") or []
    where = (
        ", ".join(f"epoch {d['epoch'] + 1} at sample {d['position']}" for d in data if d.get("position") is not None)
        or "not recorded"
    )
    rows = [
        ("checkpoint", manifest["path"]),
        ("written", f"{manifest['created']} by phalanx {manifest['phalanx']}, torch {manifest['torch']}"),
        ("progress", f"step {manifest['step']}, epoch {manifest['epoch'] + 1}; data position: {where}"),
        (
            "strategy",
            f"{manifest['strategy']} over {manifest['world_size']} process(es), {describe_layout(manifest['layout'])}",
        ),
        ("batch", f"global batch {manifest['global_batch_size']}, precision {manifest['precision']}"),
        (
            "models",
            "; ".join(
                f"{i}: {m['parameters']:,} parameters in {len(m['shapes'])} tensors"
                for i, m in enumerate(manifest["models"])
            ),
        ),
        ("optimizers", ", ".join(manifest["optimizers"]) or "none"),
        (
            "files",
            f"{len(manifest['files'])} files, {format_bytes(sum(f['bytes'] for f in manifest['files'].values()))}"
            + ("" if args.no_verify else ", all match their SHA-256"),
        ),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console().print(table)
    return 0


def _export(args: argparse.Namespace) -> int:
    manifest, state = export(args.path, args.out, args.model, args.format)
    count = sum(v.numel() for v in state.values())
    loader = "safetensors.torch.load_file" if output_format(args.out, args.format) == "safetensors" else "torch.load"
    print(
        f"phalanx: wrote {args.out}: {len(state)} tensors, {count:,} values of model {args.model} "
        f"at step {manifest['step']} "
        f"(saved by {manifest['strategy']}); load it with model.load_state_dict({loader}('{args.out}'))"
    )
    return 0
