"""``phalanx checkpoint info`` and ``phalanx checkpoint export``."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from phalanx.checkpoint.export import FORMATS, export, open_checkpoint, output_format, progress_words
from phalanx.checkpoint.files import describe_layout, describe_processes
from phalanx.checkpoint.hf_model import recorded_class
from phalanx.cli import options
from phalanx.cli.console import console
from phalanx.errors import PhalanxError
from phalanx.util.units import format_bytes, parse_size


def register(commands) -> None:
    parser = commands.add_parser(
        "checkpoint", help="inspect a checkpoint, or export its weights as a state dict or a Hugging Face directory"
    )
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
        help="write one model's weights as a plain state dict or a Hugging Face model directory",
        description=(
            "Write a consolidated state dict (no 'module.' prefix, whichever strategy saved it) "
            "that loads into the bare model with model.load_state_dict(torch.load(OUT)), or, as a "
            ".safetensors file, with model.load_state_dict(safetensors.torch.load_file(OUT)); with "
            "--format hf, a directory of safetensors shards, their index and the model's config.json "
            "that transformers' from_pretrained(OUT) loads."
        ),
    )
    out.add_argument("path", help="a checkpoint directory, its parent or its 'latest' file")
    out.add_argument("out", help="the .pt or .safetensors file to write (with --format hf: the directory)")
    out.add_argument(
        "--model", type=int, default=0, metavar="N", help="which model, when the run set up several (default 0)"
    )
    out.add_argument(
        "--format",
        choices=(*FORMATS, "hf"),
        default=None,
        help="the file format (default: safetensors when OUT ends in .safetensors, else pt); hf: a Hugging Face "
        "model directory",
    )
    out.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="with --format hf: the largest shard file, e.g. 5G or 500M (K, M, G: powers of 1024; default 5G)",
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
        ("progress", f"{progress_words(manifest)}; data position: {where}"),
        (
            "strategy",
            f"{describe_processes(manifest)}, {describe_layout(manifest['layout'])}",
        ),
        ("batch", f"global batch {manifest['global_batch_size']}, precision {manifest['precision']}"),
        (
            "models",
            "; ".join(
                f"{i}: {m['parameters']:,} parameters in {len(m['shapes'])} tensors{_hf(manifest, i)}"
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


def _hf(manifest: dict, model: int) -> str:
    kind = recorded_class(manifest, model)
    return f" ({kind}, with its config: export it with --format hf)" if kind else ""


def _export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        return _export_hf(args)
    if args.max_shard_size is not None:
        raise PhalanxError("--max-shard-size applies to --format hf only; add --format hf, or leave it out")
    manifest, state = export(args.path, args.out, args.model, args.format)
    count = sum(v.numel() for v in state.values())
    loader = "safetensors.torch.load_file" if output_format(args.out, args.format) == "safetensors" else "torch.load"
    print(
        f"phalanx: wrote {args.out}: {len(state)} tensors, {count:,} values of model {args.model} "
        f"at step {manifest['step']} "
        f"(saved by {manifest['strategy']}); load it with model.load_state_dict({loader}('{args.out}'))"
    )
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from phalanx.checkpoint.hf_export import DEFAULT_MAX_SHARD, describe_shards, export_hf

    limit = DEFAULT_MAX_SHARD if args.max_shard_size is None else parse_size(args.max_shard_size)
    done = export_hf(args.path, args.out, args.model, limit)
    manifest = done.manifest
    head = (
        f"phalanx: wrote {args.out}: {done.tensors} tensors, {done.values:,} values of model {args.model} "
        f"at step {manifest['step']} (saved by {manifest['strategy']}) {describe_shards(done, limit)}"
    )
    if done.config is None:
        print(
            f"{head}; the checkpoint holds no Hugging Face config (the model had no .config when it was saved): "
            f"copy the model's config.json into {args.out}, then load it with from_pretrained('{args.out}')"
        )
        return 0
    kind = (done.config.get("architectures") or ["AutoModel"])[0]
    print(
        f"{head}, with {' and '.join(f for f in done.files if f.endswith('config.json'))}; "
        f"load it with {kind}.from_pretrained('{args.out}')"
    )
    return 0
