"""lm-evaluation-harness (`lm_eval`, PyPI) scores a loglikelihood task of pdfleet's own against a router: its
`local-completions` model sends what it sends to any OpenAI server (token-id prompts, `echo`, `logprobs` 1, `max_tokens`
1) and reads the prompt's logprobs back.

    python3 bench/lm_eval_router.py --install       # once: .venv-lmeval with LMEVAL_PINS (about 2 minutes)
    .venv-lmeval/bin/python bench/lm_eval_router.py --url http://127.0.0.1:8000 --model tiny --tokenizer models/tiny

It runs in its own virtualenv (lm_eval and its pins stay out of the project's; no torch is installed there).
The task is bench/lm_eval_task/pdfleet_python_mc.yaml: which of four continuations of a Python snippet the model
finds likeliest, 20 documents in the JSON lines beside it (nothing is downloaded). Prints lm_eval's table, then
one JSON line: the task's accuracy and, per document, the loglikelihood of each choice as lm_eval computed it,
so that a test can hold them against the same sums taken offline (tests/worker/server/test_prompt_scoring.py).
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LMEVAL_VENV = os.path.join(ROOT, ".venv-lmeval")
TASK_DIR = os.path.join(ROOT, "bench", "lm_eval_task")
TASK = "pdfleet_python_mc"
# What `pip install "lm-eval[api]==0.4.13" transformers==5.24.0` resolved to (December 2026), installed with --no-deps
# so that nothing else (a CUDA torch above all) can come in; transformers only loads the tokenizer.
LMEVAL_PINS = [
    "lm_eval==0.4.13",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "absl-py==2.5.1",
    "aiohappyeyeballs==2.7.1",
    "aiohttp==3.14.5",
    "aiosignal==1.4.0",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "attrs==26.1.0",
    "certifi==2026.10.19.post1",
    "chardet==6.0.0.post1",
    "charset-normalizer==3.5.3",
    "click==8.5.1",
    "cloudpickle==3.1.3",
    "colorama==0.4.6",
    "DataProperty==1.1.1",
    "datasets==5.2.0",
    "defusedxml==0.7.1",
    "dill==0.4.1",
    "evaluate==0.4.6",
    "filelock==4.3.1",
    "frozenlist==1.8.0",
    "fsspec==2026.9.0",
    "h11==0.16.0",
    "hf-xet==1.8.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface_hub==2.4.0",
    "idna==3.20",
    "Jinja2==3.1.6",
    "joblib==1.6.0",
    "lxml==6.1.3",
    "markdown-it-py==4.3.0",
    "MarkupSafe==3.0.4",
    "mbstrdecoder==1.1.5",
    "mdurl==0.1.2",
    "more-itertools==11.2.1",
    "multidict==7.2.1",
    "multiprocess==0.70.19",
    "narwhals==2.29.0",
    "nltk==3.10.4",
    "numpy==2.4.6",
    "packaging==26.4",
    "pandas==3.1.1",
    "pathvalidate==3.3.1",
    "portalocker==4.4.2",
    "propcache==0.5.4",
    "pyarrow==26.0.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "Pygments==2.21.0",
    "pytablewriter==1.2.1",
    "python-dateutil==2.9.0.post0",
    "pytz==2026.6",
    "PyYAML==6.0.4",
    "regex==2026.11.19",
    "requests==2.34.2",
    "rich==15.0.0",
    "rouge_score==0.1.2",
    "sacrebleu==2.6.0",
    "safetensors==0.8.0",
    "scikit-learn==1.9.1",
    "scipy==1.17.1",
    "shellingham==1.5.4",
    "six==1.17.0",
    "sqlitedict==2.1.0",
    "tabledata==1.3.5",
    "tenacity==9.2.1",
    "tiktoken==0.14.0",
    "tabulate==0.10.0",
    "tcolorpy==0.1.7",
    "threadpoolctl==3.8.0",
    "tqdm==4.70.1",
    "truststore==0.10.5",
    "typepy==1.3.5",
    "typer==0.29.2",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
    "word2number==1.1",
    "xxhash==4.1.0",
    "yarl==1.25.1",
]


def install() -> int:
    """Create .venv-lmeval and install LMEVAL_PINS into it (any Python 3.11+ runs this)."""
    python = os.path.join(LMEVAL_VENV, "bin", "python")
    if not os.access(python, os.X_OK):
        subprocess.run([sys.executable, "-m", "venv", LMEVAL_VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", *LMEVAL_PINS], check=True)
    subprocess.run(
        [
            python,
            "-c",
            "import lm_eval, transformers, datasets, tenacity\n"
            "import importlib.util as u\nassert u.find_spec('torch') is None, 'torch came in'",
        ],
        check=True,
    )
    print(f"{LMEVAL_VENV}: lm_eval 0.4.13 (no torch)")
    return 0


def task_dir(tmp: str) -> str:
    """The task's YAML with data_files made absolute (lm_eval reads it relative to the working directory)."""
    with open(os.path.join(TASK_DIR, f"{TASK}.yaml")) as f:
        text = f.read()
    text = text.replace(f"test: {TASK}.jsonl", f"test: {os.path.join(TASK_DIR, TASK + '.jsonl')}")
    with open(os.path.join(tmp, f"{TASK}.yaml"), "w") as f:
        f.write(text)
    return tmp


def run(url: str, model: str, tokenizer: str, limit: int | None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    with tempfile.TemporaryDirectory() as tmp:
        model_args = (
            f"model={model},base_url={url.rstrip('/')}/v1/completions,tokenizer={os.path.abspath(tokenizer)},"
            f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1"
        )
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=task_dir(tmp)),
            log_samples=True,
            limit=limit,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    print(make_table(results))
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return {
        "task": TASK,
        "acc": results["results"][TASK]["acc,none"],
        "samples": [
            {"doc_id": s["doc_id"], "target": s["target"], "loglikelihoods": [float(r[0][0]) for r in s["resps"]]}
            for s in samples
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="create .venv-lmeval and exit")
    ap.add_argument("--url", help="the router (or any OpenAI completions server)")
    ap.add_argument("--model", default="tiny", help="served model name")
    ap.add_argument("--tokenizer", help="the model directory (its tokenizer.json)")
    ap.add_argument("--limit", type=int, default=None, help="score the first N documents only")
    args = ap.parse_args()
    if args.install:
        return install()
    if not (args.url and args.tokenizer):
        ap.error("--url and --tokenizer are needed (or --install)")
    print(json.dumps(run(args.url, args.model, args.tokenizer, args.limit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
