"""The ``magicserve`` command line.

Subcommands:
  serve     bring up the cluster of a config (Ray, its pools: prefill + decode with KV channels, or
            colocated reference-engine instances) and serve gRPC
  generate  a gRPC client: stream a completion to the terminal
  status    a gRPC client: print the cluster's instances, queues, KV memory and acceptance rates
  demo      start the embedded default (cluster_configs/local.yaml), stream a few prompts, print
            TTFT / TPOT / acceptance, shut down
  run       generate locally with the single-process reference engine (no server, no Ray)
  profile   measure a config's costs on this machine, or model a GPU type analytically, for the planner
  plan      search parallelism, instance counts and speculation settings for SLOs; write the cluster YAML
  build     compile the CPU attention kernel now (once per machine) into the cache the workers load it
            from, so the first request does not wait for it; a failed build says so in one line and
            exits 0 (attention then falls back to the torch backend)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time

import grpc
import torch

from controller.config import LOCAL_CONFIG, load_config
from controller.defaults import DEFAULT_MODEL_DIR, DEMO_PROMPTS, DEMO_SAMPLING
from frontend.client import Client
from modeling.attention import cpu_kernel as kernel
from modeling.dtype_choice import choose_dtype
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import MagicServeError
from modeling.sampling import SamplingParams
from planner.plan_cli import add_arguments as add_plan_arguments
from planner.plan_cli import run as run_plan
from planner.profile_cli import run_cli as run_profile


def serve_forever(config, **kwargs):
    """``frontend.server.serve_forever``, imported when a command starts a cluster: the server module
    brings Ray and the worker actors, which the client commands never need."""
    from frontend.server import serve_forever as serve

    return serve(config, **kwargs)


def serve_with_client(config):
    """``frontend.server.serve_with_client`` (the calibration's ``serve``), imported as ``serve_forever`` is."""
    from frontend.server import serve_with_client as serve

    return serve(config)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="local HF checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the device computes it natively, float32 elsewhere on CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def _add_client_args(p: argparse.ArgumentParser, operator: bool = False) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port of a magicserve server")
    if operator:  # drain, migrate: the server's admin token when it has one (server.admin_token_env)
        p.add_argument("--token-env", default="MAGICSERVE_ADMIN_TOKEN",
                       help="environment variable holding the operator's bearer token (unset: MAGICSERVE_TOKEN's)")
    else:
        p.add_argument("--token-env", default="MAGICSERVE_TOKEN", help="environment variable holding the bearer token")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM) to connect with TLS")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="magicserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a cluster config over gRPC")
    serve.add_argument("--config", default=LOCAL_CONFIG, help="cluster config YAML (default: the embedded local.yaml)")
    serve.add_argument("--port", type=int, default=None, help="override server.port (gRPC)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="override server.http_port (the OpenAI-compatible HTTP front and /metrics; -1: off)")
    serve.add_argument("--pass-log-rpc", action="store_true",
                       help="override server.pass_log_rpc: serve DrainPassLog (the workers' timed passes)")
    gen = sub.add_parser("generate", help="stream a completion from a server")
    _add_client_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    status = sub.add_parser("status", help="show a server's cluster status")
    _add_client_args(status)
    drain = sub.add_parser("drain", help="migrate every request off a decode instance and place none there "
                                         "(scale-down, maintenance)")
    _add_client_args(drain, operator=True)
    drain.add_argument("instance", help="the decode instance's name (see `magicserve status`)")
    drain.add_argument("--undo", action="store_true", help="take the instance back into service")
    drain.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for it to empty (0: the "
                                                                  "server's default, 600)")
    scale = sub.add_parser("scale", help="resize a pool while serving (no request lost); the pool is held at "
                                          "that size until --release")
    _add_client_args(scale, operator=True)
    scale.add_argument("pool", help="prefill, decode or colocated")
    scale.add_argument("instances", type=int, help="instances to have in service")
    scale.add_argument("--release", action="store_true", help="do not hold the pool at this size")
    scale.add_argument("--from", dest="switch_from", default="", metavar="POOL",
                       help="take the instances from POOL (or give them back to it), each changing role in place "
                            "instead of being placed or stopped: e.g. `magicserve scale decode 2 --from prefill`")
    migrate = sub.add_parser("migrate", help="move a decoding request to another decode instance while it streams")
    _add_client_args(migrate, operator=True)
    migrate.add_argument("request_id")
    migrate.add_argument("--to", default="", help="destination decode instance (default: the freest other one)")
    migrate.add_argument("--timeout", type=float, default=0.0,
                         help="abort if not committed within this many seconds (0: migration.timeout_s)")
    demo = sub.add_parser("demo", help="start the embedded default cluster and stream a few prompts")
    demo.add_argument("--config", default=LOCAL_CONFIG)
    demo.add_argument("--max-tokens", type=int, default=48)
    run = sub.add_parser("run", help="generate locally with the reference engine (no server)")
    _add_engine_args(run)
    _add_sampling_args(run)
    run.add_argument("--prompt", required=True)
    _add_profile_parser(sub)
    add_plan_arguments(sub.add_parser("plan", help="choose a cluster config that maximises goodput under SLOs",
                                      description="Simulate candidate configurations on a profile and write the "
                                                  "best as a cluster YAML plus a report of every candidate."))
    sub.add_parser("build", help="compile the CPU attention kernel now (once per machine)")
    return parser


PROFILE_HELP = """Write a hardware profile (JSON) for the planner and simulator.

  measured (this machine, the config's model, dtype, drafter and threads per worker):
    magicserve profile --config CLUSTER_YAML --out PROFILE.json [--quick] [--calibrate]
  calibration of the serving path for another mode's config (e.g. colocated), into the same profile:
    magicserve profile --config cluster_configs/local-colocated.yaml --out PROFILE.json --calibrate-only
  the config mode's calibration fitted again to the measurements the profile keeps (after a change of the fit):
    magicserve profile --config CLUSTER_YAML --out PROFILE.json --refit-calibration
  more CPU instance shapes: one process of T threads, or T rank processes (tensor parallel, gloo):
    magicserve profile --config CLUSTER_YAML --out PROFILE.json --add-threads 2
    magicserve profile --config CLUSTER_YAML --out PROFILE.json --add-tensor-parallel 2
  analytical (a GPU type from planner/analytical.py, TP 1/2/4/8 where the model fits):
    magicserve profile --analytical --gpu H100-80GB-SXM --model llama-3.1-8b|HF_CHECKPOINT_DIR --out PROFILE.json
        [--acceptance-from MEASURED.json | --acceptance self_sparse:256:0.8 ...] [--transfer-gbps 25]
"""


def _add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure (or model analytically) the costs the planner needs",
                       description=PROFILE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--config", default=LOCAL_CONFIG, help="cluster config YAML to measure (default: local.yaml)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--calibrate", action="store_true",
                   help="also serve the config for real and fit the serving-path terms of its mode (about 1 min)")
    p.add_argument("--calibrate-only", action="store_true",
                   help="add the config mode's calibration to the existing profile at --out (no re-measuring)")
    p.add_argument("--refit-calibration", action="store_true",
                   help="fit the config mode's calibration again to the measurements stored in --out (no serving)")
    p.add_argument("--calibration-requests", type=int, default=16, help="isolated requests timed for calibration")
    p.add_argument("--add-threads", type=int, nargs="+", default=None, metavar="T",
                   help="extend the CPU profile at --out with single-process instances of T torch threads")
    p.add_argument("--add-tensor-parallel", type=int, nargs="+", default=None, metavar="T",
                   help="extend the CPU profile at --out with tensor-parallel instances of T rank processes "
                        "(each of the config's threads), measured as served")
    p.add_argument("--analytical", action="store_true", help="model a GPU type instead of measuring")
    p.add_argument("--gpu", help="GPU type (analytical), e.g. A100-80GB-SXM, H100-80GB-SXM, H200-141GB, L40S")
    p.add_argument("--model", help="model (analytical): llama-3.1-8b, llama-3.1-70b or an HF checkpoint dir")
    p.add_argument("--draft-model", help="draft model shape or dir (analytical), for drafter draft_model")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="tensor-parallel degrees (analytical)")
    p.add_argument("--acceptance-from", help="take acceptance rates from this (measured) profile (analytical)")
    p.add_argument("--acceptance", action="append", default=[], metavar="DRAFTER:BUDGET:RATE",
                   help="an acceptance rate for all contexts (analytical; repeatable)")
    p.add_argument("--transfer-gbps", type=float, default=25.0,
                   help="prefill -> decode KV link, GB/s (analytical; 25 = 200 Gb/s network, ~450 = NVLink)")


def _engine(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    choice = choose_dtype(args.dtype, "cuda" if args.device.startswith("cuda") else "cpu")
    print(f"magicserve: {args.model} in {choice.describe()}", file=sys.stderr, flush=True)
    return ReferenceEngine(args.model, EngineConfig(dtype=choice.dtype, device=args.device, kv_cache_tokens=32768))


def cmd_run(args) -> int:
    engine = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    engine.add_request(args.prompt, params)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_serve(args) -> int:
    server = {**({"port": args.port} if args.port is not None else {}),
              **({"http_port": args.http_port if args.http_port >= 0 else None} if args.http_port is not None else {}),
              **({"pass_log_rpc": True} if args.pass_log_rpc else {})}
    config = load_config(args.config, {"server": server} if server else None)
    print(f"magicserve: starting {config.describe_pools()} of {config.model_path} in "
          f"{config.dtype_choice.describe()}", flush=True)

    def ready(ports) -> None:
        host = config.server.host
        http = f", OpenAI-compatible HTTP on http://{host}:{ports.http}/v1" if ports.http is not None else ""
        if ports.startup is not None:
            print(f"magicserve: {ports.startup.describe()}", flush=True)
        print(f"magicserve: serving {config.model_path} ({config.describe_pools()}): gRPC on {host}:{ports.grpc}"
              f"{http}; Ctrl-C to stop", flush=True)

    asyncio.run(serve_forever(config, ready_callback=ready))
    return 0


def _client(args):
    token = os.environ.get(args.token_env) or os.environ.get("MAGICSERVE_TOKEN") or None
    return Client(args.address, token=token, tls_ca=args.tls_ca)


def cmd_generate(args) -> int:
    with _client(args) as client:
        try:
            for chunk in client.generate_stream(
                    args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop):
                if not chunk.final:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                else:
                    u = chunk.usage
                    print(f"\n[{chunk.finish_reason}: {u['completion_tokens']} tokens, TTFT {u['ttft_ms']:.0f} ms, "
                          f"TPOT {u['mean_tpot_ms']:.1f} ms, accepted drafts {u['accepted_draft_tokens']}/{u['draft_tokens']}]",
                          file=sys.stderr)
        except grpc.RpcError as err:
            print(f"magicserve: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


def cmd_status(args) -> int:
    with _client(args) as client:
        try:
            st = client.status()
        except grpc.RpcError as err:
            print(f"magicserve: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"model {st.model}: {st.running_requests} running, {st.queued_requests} queued")
    if st.dtype:
        print(f"dtype {st.dtype} ({st.dtype_reason})")
    # queue: a prefill instance's prompts waiting; a decode instance's requests waiting for their KV, and after
    # "+" the prompts it prefills itself
    print(f"{'instance':<12} {'role':<10} {'device':<8} {'alive':<6} {'queue':>7} {'running':>7} "
          f"{'free KV blocks':>16} {'cached':>7} {'prefix hits':>11} {'accept':>7} {'failed calls':>12}")
    for i in st.instances:
        hits = f"{i.prefix_cache_hits / i.prefix_cache_queries:.0%}" if i.prefix_cache_queries else "-"
        queue = f"{i.queue_length}+{i.local_prefills}" if i.local_prefills else str(i.queue_length)
        print(f"{i.name:<12} {i.role:<10} {i.device:<8} {str(i.alive):<6} {queue:>7} {i.running:>7} "
              f"{i.free_kv_blocks:>7}/{i.total_kv_blocks:<8} {i.cached_kv_blocks:>7} {hits:>11} "
              f"{i.acceptance_rate:>7.2f} {i.call_failures:>12}")
    for i in st.instances:
        for t in i.kv_tiers:
            print(f"{i.name:<12} kv tier {t.tier}: {t.blocks} blocks, {t.bytes / 2**20:.0f}/{t.capacity_bytes / 2**20:.0f} MiB, "
                  f"{t.hits} blocks loaded in {t.load_seconds:.2f} s ({t.read_ahead} read ahead), {t.stored} stored, "
                  f"{t.evictions} evicted, {t.corrupt} corrupt")
    if st.kv_store_segments:
        used = sum(g.used_bytes for g in st.kv_store_segments)
        capacity = sum(g.capacity_bytes for g in st.kv_store_segments)
        print(f"kv store: {st.kv_store_objects} blocks, {used / 2**20:.0f}/{capacity / 2**20:.0f} MiB in "
              f"{len(st.kv_store_segments)} segment servers")
        for g in st.kv_store_segments:
            print(f"  segment {g.name} (node {g.node[:8] or '?'}): {g.used_bytes / 2**20:.0f}/"
                  f"{g.capacity_bytes / 2**20:.0f} MiB")
    if st.load_aware_placements:
        print("load-aware placements: " + ", ".join(f"{c.count} on {c.prefilled_on} ({c.reason})"
                                                    for c in st.load_aware_placements))
    for p in st.pools:
        held = ", held" if p.held else ""
        print(f"pool {p.pool}: {p.current} in service, {p.desired} desired{held} ({', '.join(p.instances)})")
    for r in st.recent_scaling[-5:]:
        _print_scale(r)
    return 0


def _print_scale(r) -> None:
    changes = [f"+{n}" for n in r.added] + [f"-{n}" for n in r.removed] + \
        [f"~{n} (role changed, {r.switch_from} <-> {r.pool})" for n in r.switched]
    outcome = f"stopped: {r.error}" if r.error else "done"
    handed = f", {r.handed_back} requests not begun placed anew" if r.handed_back else ""
    print(f"scale {r.pool} -> {r.desired}: {' '.join(changes) or 'no change'}{handed}, {outcome} in {r.seconds:.1f} s")


def cmd_scale(args) -> int:
    with _client(args) as client:
        try:
            res = client.scale(args.pool, args.instances, hold=False if args.release else None,
                               switch_from=args.switch_from)
        except grpc.RpcError as err:
            print(f"magicserve: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    _print_scale(res)
    print(f"pool {res.pool}: {res.current} in service")
    return 1 if res.error else 0


def _print_migration(m) -> None:
    outcome = "moved" if m.committed else f"stayed ({m.reason})"
    print(f"{m.request_id}: {m.source} -> {m.destination} {outcome} in {m.seconds * 1e3:.0f} ms")


def cmd_drain(args) -> int:
    with _client(args) as client:
        try:
            res = client.drain(args.instance, undo=args.undo, timeout_s=args.timeout)
        except grpc.RpcError as err:
            print(f"magicserve: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    if args.undo:
        print(f"{res.instance}: back in service")
        return 0
    for m in res.migrations:
        _print_migration(m)
    moved = sum(m.committed for m in res.migrations)
    state = "drained" if res.drained else "NOT drained (timed out; it still holds requests)"
    print(f"{res.instance}: {state}; {moved} request(s) migrated, {res.finished_in_place} finished in place, "
          f"{res.handed_back} not begun placed anew; no new requests go there until "
          f"`magicserve drain {res.instance} --undo`")
    return 0 if res.drained else 1


def cmd_migrate(args) -> int:
    with _client(args) as client:
        try:
            res = client.migrate(args.request_id, args.to, args.timeout)
        except grpc.RpcError as err:
            print(f"magicserve: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    _print_migration(res)
    return 0 if res.committed else 1


def cmd_demo(args) -> int:
    """Bring up the embedded cluster in this process, stream the demo prompts over real gRPC."""
    config = load_config(args.config, {"server": {"port": 0, "http_port": None}})
    print(f"magicserve demo: {config.describe_pools()} on a local Ray cluster, model {config.model_path} in "
          f"{config.dtype_choice.describe()}")
    start = time.perf_counter()
    ready: list[int] = []
    state: dict = {}

    def run_server() -> None:
        async def main() -> None:
            state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
            await serve_forever(config, ready_callback=ready.append, stop_event=state["stop"])
        try:
            asyncio.run(main())
        except Exception as err:  # surfaced to the main thread below
            state["error"] = err

    thread = threading.Thread(target=run_server, name="magicserve-server", daemon=True)
    thread.start()
    while not ready and thread.is_alive():
        time.sleep(0.1)
    if not ready:
        raise RuntimeError(f"cluster failed to start: {state.get('error')}")
    print(f"cluster up in {time.perf_counter() - start:.1f}s, gRPC on 127.0.0.1:{ready[0].grpc}\n")
    try:
        with Client(f"127.0.0.1:{ready[0].grpc}") as client:
            for prompt in DEMO_PROMPTS:
                print(f"--- prompt ---\n{prompt}", end="")
                sys.stdout.write("\033[1m")
                for chunk in client.generate_stream(prompt, max_tokens=args.max_tokens, **DEMO_SAMPLING):
                    if not chunk.final:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    else:
                        u = chunk.usage
                        acc = u["accepted_draft_tokens"] / u["draft_tokens"] if u["draft_tokens"] else 0.0
                        print(f"\033[0m\n    [{u['completion_tokens']} tokens, finish={chunk.finish_reason}, "
                              f"TTFT {u['ttft_ms']:.0f} ms, TPOT {u['mean_tpot_ms']:.1f} ms, "
                              f"draft acceptance {acc:.0%} ({u['accepted_draft_tokens']}/{u['draft_tokens']})]\n")
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(timeout=60)
    print(f"demo done in {time.perf_counter() - start:.1f}s; cluster shut down")
    return 0


def cmd_build(args) -> int:
    """Build the CPU attention kernel into the extension cache the workers load from. A failed build prints
    one line naming the fallback and still exits 0: it must not fail an install command."""
    if os.environ.get(kernel.DISABLE_ENV):
        print(f"magicserve: CPU attention kernel disabled by {kernel.DISABLE_ENV}; attention uses the torch backend")
        return 0
    cached = os.path.exists(kernel.cpu_kernel_library())
    print("magicserve: checking the cached CPU attention kernel ..." if cached else
          "magicserve: building the CPU attention kernel (once per machine, tens of seconds) ...", flush=True)
    try:
        compiled = kernel.build_cpu_kernel()
    except RuntimeError as err:
        print(f"magicserve: CPU attention kernel build failed ({err}); {kernel.FALLBACK_NOTE}")
        return 0
    state = f"built in {kernel.cpu_kernel_build_seconds():.1f}s" if compiled else "up to date"
    print(f"magicserve: CPU attention kernel {state} ({kernel.cpu_kernel_library()})")
    return 0


def cmd_profile(args) -> int:
    return run_profile(args, serve_with_client)


def cmd_plan(args) -> int:
    return run_plan(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    commands = {"serve": cmd_serve, "generate": cmd_generate, "status": cmd_status, "demo": cmd_demo, "run": cmd_run,
                "profile": cmd_profile, "plan": cmd_plan, "drain": cmd_drain, "migrate": cmd_migrate, "scale": cmd_scale,
                "build": cmd_build}
    try:
        return commands[args.command](args)
    except (MagicServeError, ValueError, RuntimeError) as err:
        print(f"magicserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
