"""The worker's `pdfleet` subcommands (`model init`, `worker`, `router`); the operator's CLI calls register(). No torch
at import time."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="create and inspect model directories")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="write a randomly initialised Hugging Face model directory")
    init.add_argument("dir", help="directory to write (created if missing)")
    init.add_argument(
        "--preset", choices=["tiny", "small"], default="tiny", help="tiny: a few million parameters; small: about 150M"
    )
    init.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    init.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--tie-word-embeddings", action="store_true")
    init.add_argument(
        "--if-missing",
        action="store_true",
        help="keep a model that `pdfleet model init` already wrote there with the same preset and architecture "
        "(trained or not); refuse one of another preset or from elsewhere instead of overwriting it",
    )
    train = init.add_argument_group("training (optional: without these flags the weights stay random)")
    train.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="then train it this many minutes on the standard library's sources (next-token "
        "prediction; every 10th file held out) and print the held-out perplexity",
    )
    train.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="train at most this many steps (with --train-minutes: whichever ends first)",
    )
    train.add_argument("--train-seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    train.add_argument("--train-batch", type=int, default=8, help="sequences per step (default 8)")
    train.add_argument("--train-lr", type=float, default=2e-3, help="peak AdamW learning rate (default 2e-3)")
    init.set_defaults(func=_model_init)

    from pdfleet_worker.router import router_config
    from pdfleet_worker.server import worker_config

    worker = subparsers.add_parser(
        "worker", help="serve a model: OpenAI API, /health, /ready, /metrics (prefill, decode or both)"
    )
    worker_config.add_arguments(worker)
    worker.set_defaults(func=_worker)
    router = subparsers.add_parser("router", help="the OpenAI endpoint in front of prefill/decode or colocated workers")
    router_config.add_arguments(router)
    router.set_defaults(func=_router)


def _before_torch() -> None:
    # NOTE: an installed torch_npu without its CANN libraries makes `import torch` itself fail unless backend
    # autoloading is off; the worker imports the bridge of the device it is told to use (server/device.py).
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def _model_init(args: argparse.Namespace) -> int:
    _before_torch()
    from pdfleet_worker.model import model_init

    if args.if_missing:
        try:
            made = model_init.made_by_init(args.dir)
        except ValueError as e:
            print(f"pdfleet model init: {e}", file=sys.stderr)
            return 2
        if made is not None:
            want = {"preset": args.preset, "arch": args.arch}
            if {k: made.get(k) for k in want} != want:
                print(
                    f"pdfleet model init: {args.dir} holds a {made.get('preset')} {made.get('arch')} model, not the "
                    f"{args.preset} {args.arch} one asked for; remove it (rm -r {args.dir}) to have it written",
                    file=sys.stderr,
                )
                return 2
            print(f"kept {args.dir}: {made['preset']} {made['arch']} (written by `pdfleet model init`)")
            return 0
    result = model_init.init_model(
        args.dir,
        args.preset,
        arch=args.arch,
        dtype=args.dtype,
        seed=args.seed,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    print(
        f"wrote {result.path}: {args.preset} {args.arch} {args.dtype}, {result.num_params / 1e6:.1f}M parameters, "
        f"vocab {result.vocab_size}"
    )
    if args.train_minutes is not None or args.train_steps is not None:
        from pdfleet_worker.model import model_train

        trained = model_train.train(
            args.dir,
            minutes=args.train_minutes,
            steps=args.train_steps,
            seq_len=args.train_seq_len,
            batch=args.train_batch,
            lr=args.train_lr,
            seed=args.seed,
            max_corpus_bytes=12_000_000 if args.preset == "small" else 1_000_000,
            progress=lambda msg: print(msg, flush=True),
        )
        print(
            f"trained {result.path}: {trained.steps} steps, {trained.tokens} tokens in {trained.seconds:.0f} s; "
            f"held-out perplexity {trained.held_out_ppl_before:.1f} -> {trained.held_out_ppl:.2f}"
        )
    return 0


def _worker(args: argparse.Namespace) -> int:
    from pdfleet_worker.wire.draining_server import exit_on_signal_until_serving

    exit_on_signal_until_serving()  # a SIGTERM while torch imports: exit 0, not killed by it
    _before_torch()
    from pdfleet_worker.server import threads

    # Every thread's OpenMP team: the threads --num-threads resolves to for this model.
    threads.export_openmp(args.num_threads, model=args.model)
    from pdfleet_worker.server import runner

    return runner.run(args)


def _router(args: argparse.Namespace) -> int:
    from pdfleet_worker.router import runner

    return runner.run(args)
