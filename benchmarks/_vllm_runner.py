"""Runs inside vLLM's own virtual environment (no magicserve imports): times greedy generation of the
prompts in a JSON file, plain and with vLLM's n-gram speculation, and writes the timings as JSON.

    .peers/vllm/bin/python benchmarks/_vllm_runner.py PROMPTS.json OUT.json
"""

import json
import sys
import time


def timed_generate(llm, prompts, max_tokens, repeats):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    times.sort()
    return times[len(times) // 2], [list(o.outputs[0].token_ids) for o in outs]


def main():
    spec_in, out_path = sys.argv[1], sys.argv[2]
    with open(spec_in) as f:
        job = json.load(f)
    from vllm import LLM

    results = []
    for mode in ("plain", "ngram"):
        # no prefix caching: the timed runs repeat the same prompts and must each prefill them
        kwargs = dict(model=job["model"], dtype="bfloat16", max_model_len=job["max_model_len"], enforce_eager=True,
                      max_num_seqs=job["max_num_seqs"], enable_prefix_caching=False)
        if mode == "ngram":
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        llm = LLM(**kwargs)
        for cell in job["cells"]:
            prompts = cell["prompts"]
            timed_generate(llm, prompts, 2, 1)  # warm-up
            t_prefill, _ = timed_generate(llm, prompts, 1, job["repeats"])
            t_full, tokens = timed_generate(llm, prompts, job["max_tokens"], job["repeats"])
            decoded = len(prompts) * (job["max_tokens"] - 1)
            decode_s = t_full - t_prefill
            # decode time is the difference of two medians; when it is within the prefill's run-to-run
            # noise the throughput is meaningless (it once came out at 1e11 tokens/s): report none
            valid = decode_s > 0.1 * t_full
            results.append({"mode": mode, "batch": len(prompts), "prefix": len(prompts[0]),
                            "prefill_s": t_prefill, "total_s": t_full,
                            "decode_tokens_per_s": decoded / decode_s if valid else None,
                            "first_tokens": [t[:16] for t in tokens]})
            print(json.dumps({k: v for k, v in results[-1].items() if k != "first_tokens"}), flush=True)
        del llm
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
