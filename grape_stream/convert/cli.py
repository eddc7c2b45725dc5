"""`grape-stream convert SOURCE --input PATH_OR_GLOB... --out DIR_OR_URL [options]`.

A thin argparse layer over `grape_stream.convert.pipeline.convert`; docs/converters.md has one worked example per
source. Run under `grape-stream` (:func:`grape_stream.errors.run_cli`), a known failure prints one line. Exit
status: 0 done, 1 bad input under --strict, an output that holds another conversion, or storage that cannot be
reached / written (re-run the same command to resume), 2 a usage error (unknown option, missing input file,
inconsistent options).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from grape_stream.console import is_quiet
from grape_stream.convert.pipeline import convert
from grape_stream.convert.readers import REGISTRY, reader_options
from grape_stream.errors import ConfigError, DataError, StorageError, UserFacingError

__all__ = ["main", "build_parser"]


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grape-stream convert",
        description="Convert a corpus into per-domain MDS shards (OUT/<domain>[/<split>]/), locally or to s3://.",
        epilog="Re-run the same command after an interruption to resume. See docs/converters.md.",
    )
    p.add_argument("source", choices=tuple(REGISTRY), help="input layout")
    p.add_argument("--input", "-i", required=True, nargs="+", action="extend", metavar="PATH",
                   help="input files, globs (quote them) or directories; repeatable")
    p.add_argument("--out", "-o", required=True, help="output directory, or a remote URL such as s3://bucket/prefix")

    t = p.add_argument_group("tokens and samples")
    t.add_argument("--tokenizer", default="gpt2",
                   help="gpt2 (offline), bytes (UTF-8 bytes, EOS=256), a tokenizer.json path or a Hugging Face name "
                        "(default: gpt2)")
    t.add_argument("--eos-id", type=int, default=None,
                   help="end-of-sequence id, when the tokenizer's cannot be guessed")
    t.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default: 1024)")
    t.add_argument("--eos", choices=("auto", "always", "none"), default="auto",
                   help="EOS after each document: auto = unless it already ends with EOS (default), always, none")
    t.add_argument("--remainder", choices=("drop", "pad"), default="drop",
                   help="last partial sequence of each work unit: drop (default) or pad with a loss_mask column")
    t.add_argument("--per-example", action="store_true",
                   help="one padded sample per record with a loss_mask (always on for the task source)")

    s = p.add_argument_group("domains and splits")
    s.add_argument("--holdout", type=float, default=None, metavar="FRACTION",
                   help="carve a val split of this fraction per domain (splits train/val)")
    s.add_argument("--split", default=None, metavar="NAME=FRAC,...",
                   help="hash splits, e.g. train=0.8,probe=0.1,test=0.1")
    s.add_argument("--split-seed", type=int, default=0, help="seed of the hash split (default: 0)")
    _add_reader_flags(p.add_argument_group("reader options (each applies to the sources named)"))

    w = p.add_argument_group("output and execution")
    w.add_argument("--workers", type=int, default=1, help="worker processes (default: 1)")
    w.add_argument("--files-per-unit", type=int, default=1, help="input files per work unit (default: 1)")
    w.add_argument("--compression", default="zstd", help="shard compression, e.g. zstd, zstd:7 or none (default: zstd)")
    w.add_argument("--shard-size", default="64mb", help="uncompressed shard size limit (default: 64mb)")
    w.add_argument("--hashes", default="", help="comma-separated shard hashes, e.g. sha1,xxh64")
    w.add_argument("--local", default=None, help="staging/resume directory for a remote --out")
    w.add_argument("--keep-local", action="store_true", help="keep the staged shards after uploading them")
    w.add_argument("--strict", action="store_true", help="stop at the first bad input, naming file and line")
    w.add_argument("--text-errors", choices=("repair", "skip"), default="repair",
                   help="text with lone surrogates or control characters: repair it (U+FFFD / dropped "
                        "characters; the document is kept) or skip the document; both are counted in "
                        "report.json (default: repair)")
    w.add_argument("--overwrite", action="store_true", help="discard a previous conversion in --out and start over")
    w.add_argument("--max-examples", type=int, default=5, help="examples per bad-input kind and file in report.json")
    w.add_argument("--no-progress", action="store_true",
                   help="no progress (bars on a terminal, else a line every 5 s; --quiet implies it)")
    return p


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
    compression = None if args.compression.lower() in ("none", "") else args.compression
    try:
        result = convert(
            args.source, args.input, args.out,
            tokenizer=args.tokenizer, eos_id=args.eos_id, seq_len=args.seq_len, eos=args.eos,
            remainder=args.remainder, per_example=True if args.per_example else None,
            holdout=args.holdout, split=args.split, split_seed=args.split_seed,
            workers=args.workers, files_per_unit=args.files_per_unit, compression=compression,
            shard_size=args.shard_size, hashes=[h for h in args.hashes.split(",") if h],
            local=args.local, keep_local=args.keep_local, strict=args.strict, text_policy=args.text_errors,
            overwrite=args.overwrite,
            max_examples=args.max_examples, progress=not (args.no_progress or is_quiet()),
            **{name: getattr(args, name) for name in reader_options()},
        )
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
