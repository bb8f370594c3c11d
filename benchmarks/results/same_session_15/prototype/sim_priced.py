"""Experiment: the load speed factor priced the way the simulator prices a step (calibration scales, no burst
baseline; the decode role's measured time is its whole steps), then sim_validate --speed load with it."""
import sys
from controller.planner import load_speed as ls
from controller.planner.interference import ROLE_OF_KIND, activities
from controller.planner.profile import mixed_pass_seconds
import benchmarks.sim_validate as sv


def sim_priced(profile, mode, rows, drafter=None):
    cal = profile.calibration(mode)
    acts = activities(profile, rows, drafter)
    timed = [r for r in rows if r["kind"] not in ("step",)]
    # activities is grouped by worker; rebuild the same order of rows
    workers = list(dict.fromkeys(r.get("worker") for r in rows))
    ordered = [r for w in workers for r in rows if r.get("worker") == w and r["kind"] != "step"]
    assert len(ordered) == len(acts)
    priced = []
    for a, r in zip(acts, ordered):
        if r["kind"] == "prefill":
            base = a.seconds / a.ratio * cal.prefill_busy_scale
        elif r["kind"] == "mixed":
            base = mixed_pass_seconds(profile.prefill_model(1), profile.target_model(1), r, int(r["decode_seqs"]),
                                      int(r["decode_kv_tokens"]), cal.prefill_busy_scale, cal.decode_scale)
        else:
            base = a.seconds / a.ratio * ls.kind_scale(cal, r["kind"]) * cal.decode_scale
        priced.append((a, base))
    measured = {}
    for r in rows:
        role = ROLE_OF_KIND[r["kind"]]
        if role == "decode" and r["kind"] != "step":
            continue  # the decode role's time is its whole steps
        if role != "decode" and r["kind"] == "step":
            continue
        measured[role] = measured.get(role, 0.0) + r["seconds"]
    speed = 1.0
    for _ in range(50):
        model = {}
        for a, base in priced:
            role = ROLE_OF_KIND[a.kind]
            model[role] = model.get(role, 0.0) + base * ls._contention(cal, a, speed)
        speed = sum(measured.values()) / sum(model.values())
    return ls.LoadSpeed(speed, {k: measured[k] / model[k] for k in sorted(model)}, len(priced), measured)


import dataclasses
from controller.planner.profile import Profile

_orig = Profile.at_speed


class Split(float):
    """A factor that carries per-role factors (prefill, decode): the split experiment."""


def at_speed(self, factor):
    roles = getattr(factor, "roles", None)
    if not roles or len(roles) < 2:
        return _orig(self, float(factor))
    p, d = roles["prefill"], roles["decode"]
    pre, dec = _orig(self, p), _orig(self, d)
    instances = tuple(dataclasses.replace(a, prefill=b.prefill) for a, b in zip(dec.instances, pre.instances))
    cals = tuple(dataclasses.replace(c, ttft_overhead_s=q.ttft_overhead_s) for c, q in zip(dec.calibrations, pre.calibrations))
    return dataclasses.replace(dec, instances=instances, calibrations=cals, kv_transfer=pre.kv_transfer)


def split_priced(profile, mode, rows, drafter=None):
    est = sim_priced(profile, mode, rows, drafter)
    f = Split(est.factor)
    f.roles = est.by_role
    return ls.LoadSpeed(f, est.by_role, est.passes, est.busy_s)


Profile.at_speed = at_speed
sv.load_speed = split_priced if "--split" in sys.argv else sim_priced
sys.exit(sv.main([a for a in sys.argv[1:] if a != "--split"]))
