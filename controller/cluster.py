"""Bringing up the cluster: Ray, one placement group per pool, worker actors, KV channels.

Prefill and decode instances land on separate resource sets: each pool gets its own placement group
(one bundle per instance, ``{"CPU": cpus_per_instance, "GPU": devices_per_instance}``), so the two
pools never share a GPU. The controller process hosts the TCP store that every (prefill, decode) pair
uses to form its KV channel. In ``mode: colocated`` there is one pool, ``colocated`` (placed the same
way), of reference-engine instances, and no KV channels.
"""

from __future__ import annotations

import asyncio
import logging
import os

from controller.actors import (ColocatedActor, DecodeActor, PrefillActor, RankFollowerActor, RankSpec,
                               ray_actor_class)
from controller.config import ClusterConfig
from controller.router import Instance
from decode_worker.config import DecodeWorkerConfig
from kv_transfer.channel import Rendezvous, TransferConfig
from modeling.engine import EngineConfig
from prefill_worker.config import PrefillWorkerConfig

log = logging.getLogger("magicserve.cluster")

PLACEMENT_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    pass


def _pool_settings(cfg: ClusterConfig, pool) -> dict:
    """The worker settings every pool section gives the same way."""
    return dict(dtype=cfg.model.dtype, device="cuda" if pool.devices_per_instance else "cpu",
                block_size=pool.block_size, kv_cache_tokens=pool.kv_cache_tokens,
                attention_backend=pool.attention_backend)


def prefill_worker_config(cfg: ClusterConfig) -> PrefillWorkerConfig:
    p = cfg.prefill
    return PrefillWorkerConfig(**_pool_settings(cfg, p), token_budget=p.chunk_tokens, max_num_seqs=p.max_batch_prompts,
                               transfer=transfer_config(cfg))


def decode_worker_config(cfg: ClusterConfig) -> DecodeWorkerConfig:
    d = cfg.decode
    return DecodeWorkerConfig(**_pool_settings(cfg, d), max_num_seqs=d.max_num_seqs, speculation=d.speculation)


def colocated_engine_config(cfg: ClusterConfig) -> EngineConfig:
    c = cfg.colocated
    return EngineConfig(**_pool_settings(cfg, c), token_budget=c.chunk_tokens, max_num_seqs=c.max_num_seqs)


def transfer_config(cfg: ClusterConfig) -> TransferConfig:
    return TransferConfig(timeout_s=cfg.kv_transfer.timeout_s, interface_host=cfg.kv_transfer.rendezvous_host)


class Cluster:
    """Owns the Ray connection, placement groups, actors and the KV rendezvous store."""

    def __init__(self, config: ClusterConfig):
        disaggregated = config.mode == "disaggregated"
        if disaggregated and config.prefill.block_size != config.decode.block_size:
            raise ClusterError("decode.block_size: must equal prefill.block_size (KV moves block by block)")
        self.config = config
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self.colocated: list[Instance] = []
        self.followers: dict[str, list] = {}  # instance name -> its rank 1.. actors (tensor parallel)
        self._groups = []
        self._store = None
        self.rendezvous: Rendezvous | None = None
        self._started_ray = False

    # -- bring-up ---------------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        self._init_ray(ray)
        model = self.config.model_path
        if not os.path.isdir(model):
            raise ClusterError(f"model.path: {model} is not a directory")
        self._check_parallelism(model)
        # the store where KV pairs and tensor-parallel groups form
        self._store, self.rendezvous = Rendezvous.host_store(self.config.kv_transfer.rendezvous_host)
        if self.config.mode == "colocated":
            self._start_colocated(model)
        else:
            self._start_disaggregated(model)
        log.info("cluster up: %s", self.config.describe_pools())

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode + self.colocated

    def _check_parallelism(self, model: str) -> None:
        """Every pool's tensor_parallel must split the model's heads and MLP evenly."""
        from modeling.checkpoint import load_config
        from modeling.tp import TPShard

        config = load_config(model)
        for role, pool in self.config.pools.items():
            try:
                TPShard(0, pool.tensor_parallel).check(config, f"{role}.tensor_parallel")
            except ValueError as err:
                raise ClusterError(str(err)) from None

    def _start_disaggregated(self, model: str) -> None:
        pcfg, dcfg = prefill_worker_config(self.config), decode_worker_config(self.config)
        p, d = self.config.prefill, self.config.decode
        transfer = transfer_config(self.config)
        self.prefill = self._start_pool("prefill", p, PrefillActor, model, pcfg, lambda name: (name, p.threads))
        self.decode = self._start_pool("decode", d, DecodeActor, model, dcfg,
                                       lambda name: (name, d.threads, transfer), transfer)
        self._wait_ready()
        self._connect_all()

    def _start_colocated(self, model: str) -> None:
        ecfg = colocated_engine_config(self.config)
        c = self.config.colocated
        self.colocated = self._start_pool("colocated", c, ColocatedActor, model, ecfg, lambda name: (name, c.threads))
        self._wait_ready()

    def _wait_ready(self) -> None:
        import ray

        ray.get([i.handle.ping.remote() for i in self.instances]
                + [f.ping.remote() for fs in self.followers.values() for f in fs])

    def _init_ray(self, ray) -> None:
        rc = self.config.ray
        if ray.is_initialized():
            return
        if rc.address:
            ray.init(address=rc.address, namespace=rc.namespace, log_to_driver=True)
        else:
            pools = self.config.pools.values()
            need_cpus = sum(p.instances * p.cpus_per_instance for p in pools)
            need_gpus = sum(p.instances * p.devices_per_instance for p in pools)
            ray.init(num_cpus=rc.num_cpus if rc.num_cpus is not None else max(need_cpus, os.cpu_count() or 1),
                     num_gpus=rc.num_gpus if rc.num_gpus is not None else need_gpus,
                     namespace=rc.namespace, include_dashboard=False, log_to_driver=True)
            self._started_ray = True

    def _start_pool(self, role: str, pool, actor_cls, model: str, worker_config, args,
                    transfer: TransferConfig | None = None) -> list[Instance]:
        """Place the pool (one bundle per rank: an instance of tensor_parallel t takes t consecutive bundles,
        each with 1/t of its CPUs and devices) and start each instance's rank 0 (``actor_cls``, with
        ``model, worker_config, *args(name)``) and its followers."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = pool.tensor_parallel
        bundle = {"CPU": pool.cpus_per_instance / t}
        if pool.devices_per_instance:
            bundle["GPU"] = pool.devices_per_instance // t
        group = placement_group([dict(bundle) for _ in range(pool.instances * t)], strategy="PACK",
                                name=f"magicserve-{role}")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(group)
            raise ClusterError(f"{role}: cannot place {pool.instances} instances of {t} x {bundle} "
                               f"(cluster resources: {ray.cluster_resources()})")
        self._groups.append(group)
        # a tensor-parallel instance restarts as a whole or not at all: its ranks are not restarted one by one
        restarts = 3 if t == 1 else 0
        driver_cls = ray_actor_class(actor_cls, max_restarts=restarts)
        follower_cls = ray_actor_class(RankFollowerActor, max_restarts=0)

        def options(name: str, index: int) -> dict:
            return dict(name=name, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index))

        instances = []
        for i in range(pool.instances):
            name = f"{role}-{i}"
            specs = [RankSpec(r, t, self.rendezvous.host, self.rendezvous.port) for r in range(t)] if t > 1 else [None]
            handle = driver_cls.options(**options(f"magicserve-{name}", i * t)).remote(
                model, worker_config, *args(name), tp=specs[0])
            self.followers[name] = [
                follower_cls.options(**options(f"magicserve-{name}-rank{r}", i * t + r)).remote(
                    role, model, worker_config, name, pool.threads, specs[r], transfer)
                for r in range(1, t)]
            instances.append(Instance(name, role, handle))
        return instances

    # -- KV channels ------------------------------------------------------------------------------

    def _pair_calls(self, prefill: Instance, decode: Instance):
        """Every rank of both instances forms its own channels (the KV of each head moves rank to rank)."""
        gen = prefill.generation + decode.generation
        host, port = self.rendezvous.host, self.rendezvous.port
        p_tp, d_tp = self.config.prefill.tensor_parallel, self.config.decode.tensor_parallel
        return ([h.connect.remote(decode.name, host, port, gen, d_tp)
                 for h in [prefill.handle, *self.followers.get(prefill.name, [])]]
                + [h.connect.remote(prefill.name, host, port, gen, p_tp)
                   for h in [decode.handle, *self.followers.get(decode.name, [])]])

    def _connect_all(self) -> None:
        import ray

        refs = [r for p in self.prefill for d in self.decode for r in self._pair_calls(p, d)]
        ray.get(refs, timeout=self.config.kv_transfer.timeout_s * 4 + 60)

    async def rewire(self, inst: Instance) -> None:
        """Re-form every KV channel of an instance that Ray restarted."""
        peers = self.decode if inst.role == "prefill" else self.prefill
        refs = []
        for peer in peers:
            if peer.alive:
                p, d = (inst, peer) if inst.role == "prefill" else (peer, inst)
                refs.extend(self._pair_calls(p, d))
        await asyncio.gather(*refs)

    # -- status and shutdown ----------------------------------------------------------------------

    async def statuses(self) -> list[dict]:
        out = []
        for inst in self.instances:
            try:
                st = await asyncio.wait_for(inst.handle.status.remote(), 5.0) if inst.alive else None
            except Exception:
                st = None
            if st is None:
                st = {"name": inst.name, "role": inst.role, "device": "", "queue_length": 0, "running": 0,
                      "free_kv_blocks": 0, "total_kv_blocks": 0}
            st["alive"] = inst.alive and st.get("device", "") != ""
            out.append(st)
        return out

    async def drain_pass_logs(self) -> list[dict]:
        """Every live instance's timed passes since the last drain (``modeling/pass_log.py``): per instance
        ``name``, ``role``, ``records`` and ``dropped`` (passes its log could not keep)."""
        live = [inst for inst in self.instances if inst.alive]
        logs = await asyncio.gather(*(asyncio.wait_for(inst.handle.pass_log_counted.remote(), 30.0) for inst in live))
        return [{"name": inst.name, "role": inst.role, **log} for inst, log in zip(live, logs)]

    def shutdown(self) -> None:
        import ray

        for handle in [i.handle for i in self.instances] + [f for fs in self.followers.values() for f in fs]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        for g in self._groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()
