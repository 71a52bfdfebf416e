"""The `folio` command: `folio demo-model DIR` and `folio run`.

`folio run` is a deliberately small greedy loop over one sequence (Model + Cache + ForwardBatch) that streams text as
it is generated; the dynamic generator replaces it later.
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

DEFAULT_DEMO_DIR = Path("demo-model")
DEFAULT_PROMPT = "The lighthouse keeper"
RUN_PAGE_SIZE = 256


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="folio: a paged dynamic generator for LLMs")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo-model", help="write the tiny random-weight demo model to DIR")
    demo.add_argument("dir", type=Path, metavar="DIR")
    demo.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    demo.set_defaults(handler=_cmd_demo_model)

    run = commands.add_parser("run", help="stream a greedy generation from a model")
    run.add_argument(
        "--model", type=Path, default=None, help=f"model directory (default: the demo model, in ./{DEFAULT_DEMO_DIR})"
    )
    run.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    run.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate at most (default 64)")
    run.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    run.set_defaults(handler=_cmd_run)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from folio.demo import is_demo_model_current, write_demo_model

    was_current = is_demo_model_current(args.dir, args.seed)
    model_dir = write_demo_model(args.dir, seed=args.seed)
    verb = "already up to date" if was_current else "wrote"
    print(f"{verb}: demo model (seed {args.seed}) in {model_dir}")
    for path in sorted(model_dir.iterdir()):
        print(f"  {path.name:<24} {path.stat().st_size:>12,} bytes")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from folio.tokenizer import Tokenizer

    model_dir = args.model
    if model_dir is None:
        from folio.demo import is_demo_model_current, write_demo_model

        model_dir = DEFAULT_DEMO_DIR
        if not is_demo_model_current(model_dir):
            print(f"writing the demo model to ./{model_dir}", file=sys.stderr)
        write_demo_model(model_dir)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    from folio.model.model import Model

    tok = Tokenizer.from_pretrained(model_dir)
    model = Model.from_pretrained(model_dir, device=device, progress=sys.stderr.isatty())
    prompt_ids = tok.encode(args.prompt, add_bos=tok.add_bos_token)
    if not prompt_ids:
        print("folio run: the prompt is empty and the model adds no bos token", file=sys.stderr)
        return 2
    max_len = model.config.max_position_embeddings
    if len(prompt_ids) + args.max_new_tokens > max_len:
        print(
            f"folio run: {len(prompt_ids)} prompt tokens + {args.max_new_tokens} new tokens exceed the model's "
            f"max_position_embeddings {max_len}",
            file=sys.stderr,
        )
        return 2

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    start_s = time.perf_counter()
    num_generated = 0
    for token_id in greedy_tokens(model, tok, prompt_ids, args.max_new_tokens):
        num_generated += 1
        # token_bytes + an incremental decoder: a token may end in the middle of a UTF-8 character.
        sys.stdout.write(utf8.decode(tok.token_bytes(token_id)))
        sys.stdout.flush()
    sys.stdout.write(utf8.decode(b"", final=True) + "\n")
    elapsed_s = time.perf_counter() - start_s
    print(f"[{len(prompt_ids)} prompt + {num_generated} new tokens in {elapsed_s:.2f} s on {device}]", file=sys.stderr)
    return 0


def greedy_tokens(model, tok, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
    """Greedy decoding of one sequence over a private paged cache; stops after an eos token or max_new_tokens."""
    from folio.kv_cache import Cache
    from folio.model.batch import ForwardBatch, SeqChunk

    num_tokens = len(prompt_ids) + max_new_tokens
    cache = Cache(model, num_tokens=-(-num_tokens // RUN_PAGE_SIZE) * RUN_PAGE_SIZE, page_size=RUN_PAGE_SIZE)
    block_table = list(range(cache.num_pages))
    eos_ids = set(tok.eos_token_ids)
    chunk = SeqChunk(token_ids=prompt_ids, start_pos=0, block_table=block_table, logits="last")
    for _ in range(max_new_tokens):
        batch = ForwardBatch.build([chunk], page_size=cache.page_size, device=model.device)
        logits = model.forward(batch, cache)[0]
        # The model's vocabulary can be larger than the tokenizer's (padded embeddings); those rows are not tokens.
        token_id = int(logits[: tok.vocab_size].argmax())  # host sync on purpose: the next step needs the id
        yield token_id
        if token_id in eos_ids:
            return
        next_pos = chunk.start_pos + len(chunk.token_ids)
        chunk = SeqChunk(token_ids=[token_id], start_pos=next_pos, block_table=block_table)


if __name__ == "__main__":
    raise SystemExit(main())
