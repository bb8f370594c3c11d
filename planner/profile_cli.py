"""``magicserve profile``: the command line over the profiler (``planner/profiler.py``), the analytical GPU
profiles (``planner/analytical.py``), tensor-parallel shapes (``planner/tp_profile.py``) and the calibration
(``planner/calibrate.py``). Arguments are defined in ``frontend/cli.py``."""

from __future__ import annotations

import dataclasses

from controller.config import load_config
from decode_worker.policy import PassShape
from planner import analytical
from planner.calibrate import calibrate, refit, samples_prefix
from planner.profile import Profile, ProfileError
from planner.profiler import DEFAULT_GRID, QUICK_GRID, add_threads, profile_cluster
from planner.tp_profile import add_tensor_parallel


def run_cli(args, serve) -> int:
    """``magicserve profile`` (arguments defined in frontend/cli.py); ``serve(config)``: a context manager
    serving a config and yielding a client connected to it, for the calibration (``planner/calibrate.py``)."""
    if args.analytical:
        profile = analytical.profile_from_args(args)
        for c in profile.instances:
            print(f"tp {c.tensor_parallel}: KV capacity {c.kv_capacity_tokens} tokens; "
                  f"decode step (batch 1, 1K context) "
                  f"{1e3 * c.target_pass.predict_pass(PassShape(1, 1024, 1)):.2f} ms")
        profile.save(args.out)
        print(f"wrote {args.out}")
        return 0
    if args.model or args.gpu:
        raise ProfileError("--model and --gpu go with --analytical (a measured profile uses the config's model)")
    if args.calibration_requests < 4:
        raise ProfileError(f"--calibration-requests: must be >= 4, got {args.calibration_requests}")
    calibrating = args.calibrate or args.calibrate_only
    config = load_config(args.config)
    if args.refit_calibration:
        if calibrating or args.quick or args.add_threads or args.add_tensor_parallel:
            raise ProfileError("--refit-calibration: refits the measurements already in --out and measures nothing; "
                               "it does not combine with --calibrate, --calibrate-only, --quick, --add-threads or "
                               "--add-tensor-parallel")
        profile = Profile.load(args.out)
        cal = refit(config, profile)
        _print_calibration(cal)
        profile.with_calibration(cal).save(args.out)
        print(f"wrote {args.out}")
        return 0
    if args.add_threads or args.add_tensor_parallel:
        if calibrating:
            raise ProfileError("--add-threads / --add-tensor-parallel: extend the profile at --out with other "
                               "instance shapes; they do not combine with --calibrate or --calibrate-only")
        grid = QUICK_GRID if args.quick else DEFAULT_GRID
        profile = Profile.load(args.out)
        if args.add_threads:
            profile = add_threads(config, profile, args.add_threads, grid, progress=not args.no_progress)
        if args.add_tensor_parallel:
            profile = add_tensor_parallel(config, profile, args.add_tensor_parallel, grid,
                                          progress=not args.no_progress)
    elif args.calibrate_only:
        profile = Profile.load(args.out)
    else:
        profile = profile_cluster(config, QUICK_GRID if args.quick else DEFAULT_GRID, progress=not args.no_progress)
    if calibrating:
        run = calibrate(config, profile, serve, requests=args.calibration_requests, progress=not args.no_progress)
        cal = run.calibration
        _print_calibration(cal)
        stale = samples_prefix(cal.mode, cal.threads)  # an earlier calibration's measurements of it go
        kept = {k: v for k, v in profile.samples.items() if not k.startswith(stale)}
        profile = dataclasses.replace(profile.with_calibration(cal), samples={**kept, **run.samples()})
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0


def _print_calibration(cal) -> None:
    print(f"calibration ({cal.mode}{f', {cal.threads} threads' if cal.threads != 1 else ''}): TTFT = "
          f"{1e3 * cal.ttft_overhead_s:.1f} ms + {cal.prefill_scale:.3f} x predicted prefill (fit error "
          f"{cal.ttft_fit_error:.1%}"
          + (f"; the worker's own passes {cal.prefill_pass_scale:.3f} x" if cal.prefill_pass_scale else "")
          + f"); decode = {1e3 * cal.decode_start_s:.1f} ms + {cal.decode_scale:.3f} x predicted steps (fit error "
          f"{cal.decode_fit_error:.1%}); {cal.requests} requests"
          + (f"; speculative steps in place: verify passes {cal.verify_pass_scale:.2f}x, draft passes "
             f"{cal.draft_pass_scale:.2f}x a plain decode pass's ratio ({cal.speculative_passes} verify passes)"
             if cal.speculative_passes else ""))
