"""`grape-stream` command line: one sub-command per job, each implemented in the module that owns it.

Sub-commands are resolved lazily so `grape-stream convert --help` does not import torch or Composer.
Every sub-command runs under :func:`grape_stream.errors.run_cli`: a known failure (a
:class:`~grape_stream.errors.UserFacingError`) prints one line ``grape-stream: error: ...`` and exits 2
(1 for storage); ``--debug`` (anywhere on the line) or ``GRAPE_STREAM_DEBUG=1`` shows its traceback.
``--log-level LEVEL`` and ``--quiet`` (anywhere on the line) set how much of the log shows
(:mod:`grape_stream.console`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from grape_stream.console import configure_logging, parse_console_args
from grape_stream.errors import run_cli
from grape_stream.version import __version__

# name -> (module, function, one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "convert": ("grape_stream.convert.cli", "main", "convert a corpus into per-domain MDS shards (local or s3://)"),
    "train-tokenizer": ("grape_stream.convert.train_tokenizer", "main",
                        "train a small byte-level BPE tokenizer (tokenizer.json) on source corpora"),
    "train": ("grape_stream.integrations.composer.train_cli", "main", "train from a YAML recipe (Composer)"),
    "demo": ("grape_stream.apps.demo", "main",
             "multilingual demo: uniform vs GRAPE mixing (any method: --methods) on bundled real text"),
    "plot": ("grape_stream.apps.plots", "main", "plot a weight trajectory (JSONL) to PNG"),
    "inspect": ("grape_stream.apps.inspect", "main", "summarise an MDS output directory or a trajectory"),
    "mixture": ("grape_stream.apps.mixture", "main", "baseline mixtures: CRISP (embeddings), RegMix (proxies)"),
    "export-schedule": ("grape_stream.apps.export_schedule", "main",
                        "a run's alpha(t) as a JSON schedule or a Megatron-LM --data-path blend"),
}


def _usage() -> str:
    lines = ["usage: grape-stream COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `grape-stream COMMAND --help` for a command's options. Any command takes:",
              "  --debug            an error shows its full traceback instead of one line (or GRAPE_STREAM_DEBUG=1)",
              "  --log-level LEVEL  debug, info (default), warning or error: grape_stream's messages at LEVEL,",
              "                     other libraries' (Composer, streaming, botocore) at warning and above",
              "  --quiet            warnings and errors only; no progress lines"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = [a for a in args if a == "--debug"]
    args = [a for a in args if a != "--debug"]
    try:
        args, level, quiet = parse_console_args(args)
    except ValueError as exc:
        print(f"grape-stream: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(level, quiet=quiet, given=level is not None)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"grape-stream: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]

    def entry(argv_: list[str]) -> int:
        run: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
        return int(run(argv_) or 0)

    return run_cli("grape-stream", entry, [*rest, *debug])


if __name__ == "__main__":
    raise SystemExit(main())
