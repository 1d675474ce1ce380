"""Small helpers for the messages phalanx prints."""


def plural(n: int, noun: str) -> str:
    """``plural(1, "process")`` -> "1 process"; ``plural(2, "process")`` -> "2 processes"."""
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('s') else 's'}"
