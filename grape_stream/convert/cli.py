"""`grape-stream convert SOURCE --input PATH_OR_GLOB... --out DIR_OR_URL [options]`.

A thin argparse layer: the flags build one `grape_stream.config.ConvertConfig` (each default and meaning read
from it) that `grape_stream.convert.pipeline.convert` takes; docs/converters.md has one worked example per
source. Run under `grape-stream` (:func:`grape_stream.errors.run_cli`), a known failure prints one line. Exit
status: 0 done, 1 bad input under --strict, an output that holds another conversion, or storage that cannot be
reached / written (re-run the same command to resume), 2 a usage error (unknown option, missing input file,
inconsistent options).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from grape_stream.config import ConvertConfig, field_default, field_names
from grape_stream.console import add_console_arguments, is_quiet
from grape_stream.convert.pipeline import convert
from grape_stream.convert.readers import REGISTRY, reader_options
from grape_stream.errors import ConfigError, DataError, StorageError, UserFacingError

__all__ = ["main", "build_parser", "config_from_args"]


def _add_reader_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per reader option in the registry, its help naming the sources that accept it.

    Defaults stay None / False ("not given") so that a flag the chosen source does not accept is
    reported by build_reader instead of silently ignored; the reader's own default is in the help.
    """
    for name, (opt, sources) in reader_options().items():
        where = f"sources: {', '.join(sources)}"
        if opt.is_flag:
            group.add_argument(opt.flag, dest=name, action="store_true", help=f"{opt.help} ({where})")
            continue
        default = f"; default: {opt.default}" if opt.default is not None else ""
        group.add_argument(opt.flag, dest=name, default=None, choices=opt.choices, metavar=opt.metavar,
                           help=f"{opt.help} ({where}{default})")


def _compression(value: str) -> str | None:
    return None if value.lower() in ("none", "") else value


def _hashes(value: str) -> list[str]:
    return [h for h in value.split(",") if h]


def _option(group: argparse._ArgumentGroup, flag: str, name: str, help: str, **kwargs: Any) -> None:
    """A flag for ConvertConfig field ``name``: its default is the field's (shown in the help), stated once."""
    default = field_default(ConvertConfig, name)
    if kwargs.get("action") in ("store_true", "store_false"):
        group.add_argument(flag, dest=name, help=help, **kwargs)
    else:
        shown = f" (default: {default})" if default not in (None, []) else ""
        group.add_argument(flag, dest=name, default=default, help=help + shown, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``grape-stream convert``: one per :class:`~grape_stream.config.ConvertConfig` field (its
    default and meaning from there) and one per reader option (from the readers' registry)."""
    p = argparse.ArgumentParser(
        prog="grape-stream convert",
        description="Convert a corpus into per-domain MDS shards (OUT/<domain>[/<split>]/), locally or to s3://.",
        epilog="Re-run the same command after an interruption to resume. See docs/converters.md.",
    )
    p.add_argument("source", choices=tuple(REGISTRY), help="input layout")
    p.add_argument("--input", "-i", dest="inputs", required=True, nargs="+", action="extend", metavar="PATH",
                   help="input files, globs (quote them) or directories; repeatable")
    p.add_argument("--out", "-o", required=True, help="output directory, or a remote URL such as s3://bucket/prefix")

    t = p.add_argument_group("tokens and samples")
    _option(t, "--tokenizer", "tokenizer",
            "gpt2 (offline), bytes (UTF-8 bytes, EOS=256), a tokenizer.json path or a Hugging Face name")
    _option(t, "--eos-id", "eos_id", "end-of-sequence id, when the tokenizer's cannot be guessed", type=int)
    _option(t, "--seq-len", "seq_len", "tokens per sample", type=int)
    _option(t, "--eos", "eos", "EOS after each document: auto = unless it already ends with EOS, always, none",
            choices=("auto", "always", "none"))
    _option(t, "--remainder", "remainder", "last partial sequence of each work unit: drop, or pad with a loss_mask "
            "column", choices=("drop", "pad"))
    t.add_argument("--per-example", dest="per_example", action="store_const", const=True, default=None,
                   help="one padded sample per record with a loss_mask (always on for the task source)")

    s = p.add_argument_group("domains and splits")
    _option(s, "--holdout", "holdout", "carve a val split of this fraction per domain (splits train/val)",
            type=float, metavar="FRACTION")
    _option(s, "--split", "split", "hash splits, e.g. train=0.8,probe=0.1,test=0.1", metavar="NAME=FRAC,...")
    _option(s, "--split-seed", "split_seed", "seed of the hash split", type=int)
    _add_reader_flags(p.add_argument_group("reader options (each applies to the sources named)"))

    w = p.add_argument_group("output and execution")
    _option(w, "--workers", "workers", "worker processes", type=int)
    _option(w, "--files-per-unit", "files_per_unit", "input files per work unit", type=int)
    _option(w, "--compression", "compression", "shard compression, e.g. zstd, zstd:7 or none", type=_compression)
    _option(w, "--shard-size", "shard_size", "uncompressed shard size limit")
    _option(w, "--hashes", "hashes", "comma-separated shard hashes, e.g. sha1,xxh64", type=_hashes)
    _option(w, "--local", "local", "staging/resume directory for a remote --out")
    _option(w, "--keep-local", "keep_local", "keep the staged shards after uploading them", action="store_true")
    _option(w, "--strict", "strict", "stop at the first bad input, naming file and line", action="store_true")
    _option(w, "--text-errors", "text_policy", "text with lone surrogates or control characters: repair it "
            "(U+FFFD / dropped characters; the document is kept) or skip the document; both are counted in "
            "report.json", choices=("repair", "skip"))
    _option(w, "--max-record-size", "max_record_size", "skip (and count as record_too_large) a JSON line or text "
            "larger than this, e.g. 64mb (the default), so one huge record cannot exhaust a worker's memory")
    _option(w, "--overwrite", "overwrite", "discard a previous conversion in --out and start over",
            action="store_true")
    _option(w, "--max-examples", "max_examples", "examples per bad-input kind and file in report.json", type=int)
    _option(w, "--no-progress", "progress",
            "no progress (bars on a terminal, else a line every 5 s; --quiet implies it)", action="store_false")
    add_console_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> ConvertConfig:
    """The parsed command line as one ConvertConfig (the reader's flags under ``reader``)."""
    fields = {name: getattr(args, name) for name in field_names(ConvertConfig) if name != "reader"}
    fields["progress"] = fields["progress"] and not is_quiet()  # --quiet (any sub-command) implies --no-progress
    return ConvertConfig(**fields, reader={name: getattr(args, name) for name in reader_options()})


def _as_user_error(exc: BaseException) -> BaseException:
    """The converter's contract: a ValueError (inconsistent options, unknown tokenizer), FileNotFoundError
    (missing input) or ConnectionError (an output it cannot reach) from :func:`convert` is the user's to fix,
    so it becomes the matching UserFacingError (one line; the original is its ``__cause__``)."""
    if isinstance(exc, UserFacingError):
        return exc
    if isinstance(exc, ConnectionError):
        msg = f"{exc}; re-run the same command to resume once the storage is reachable"
        return StorageError(msg)
    if isinstance(exc, FileNotFoundError):
        return DataError(str(exc))
    if isinstance(exc, ValueError):
        return ConfigError(str(exc))
    return exc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result = convert(config_from_args(args))
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        user = _as_user_error(exc)
        if user is exc:
            raise
        raise user from exc
    print(result.table())
    if result.units_run == 0:
        print(f"already complete: {result.out} (nothing to do)")
    bad = result.report["totals"]["bad"]
    if bad:
        nfiles = sum(1 for r in result.report["files"].values() if r["bad"])
        kinds = ", ".join(f"{k}={n}" for k, n in bad.items())
        print(f"bad input in {nfiles} file(s): {kinds} -- details in {result.local}/report.json")
    for w in result.manifest.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {len(result.manifest['domains'])} domain(s) to {result.out}")
    return 0


if __name__ == "__main__":
    from grape_stream.errors import run_cli

    raise SystemExit(run_cli("grape-stream convert", main, sys.argv[1:]))
