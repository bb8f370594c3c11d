"""Bringing up the cluster: Ray, one placement group per instance, worker actors, KV channels; and
changing it while it serves (an instance added to a pool, or one removed).

Each instance gets its own placement group (one bundle per rank, PACKed: ``{"CPU": cpus_per_instance / t,
"GPU": devices_per_instance / t}``), so instances of the two pools never share a GPU, and an instance
removed from its pool gives its resources back to Ray (on a Ray cluster with an autoscaler, a group that
does not fit is what makes Ray add a node). The controller process hosts the TCP store that every
(prefill, decode) pair uses to form its KV channel. In ``mode: colocated`` there is one pool,
``colocated`` (placed the same way), of reference-engine instances, and no KV channels.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.actors import (ColocatedActor, DisaggregatedActor, RankFollowerActor, RankSpec,
                               ray_actor_class)
from controller.config import ClusterConfig
from controller.kv_store import MooncakeStoreService, placement_nodes
from controller.startup import StartupTimeline
from controller.routing import Instance
from kv_transfer.channel import Rendezvous, TransferConfig
from modeling.checkpoint import load_config
from modeling.instance_config import InstanceConfig
from modeling.tp import TPShard

log = logging.getLogger("magicserve.cluster")

PLACEMENT_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 300.0  # a restarted instance's ranks load the model and form their group within this
MAX_INSTANCE_RESTARTS = 3  # per instance; a fourth failure leaves it out of service


class ClusterError(RuntimeError):
    pass


def pool_bundle(pool) -> dict:
    """One rank's placement bundle: its share of the instance's CPUs and GPUs and, for a pool bound to a
    GPU type, a sliver of that type's ``accelerator_type:<name>`` resource (Ray's convention), so the rank
    lands only on nodes with that GPU."""
    t = pool.tensor_parallel
    bundle = {"CPU": pool.cpus_per_instance / t}
    if pool.devices_per_instance:
        bundle["GPU"] = pool.devices_per_instance // t
    if pool.accelerator_type:
        bundle[f"accelerator_type:{pool.accelerator_type}"] = 0.001
    return bundle


def place_pool(role: str, pool, timeout_s: float | None = None):
    """Reserve the pool's bundles (one per rank, PACK) in a placement group; raises ClusterError naming the
    pool and what it asked for when the cluster cannot hold them within ``timeout_s``."""

    bundle = pool_bundle(pool)
    group = placement_group([dict(bundle) for _ in range(pool.instances * pool.tensor_parallel)], strategy="PACK",
                            name=f"magicserve-{role}")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ClusterError(f"{role}: cannot place {pool.instances} instances of {pool.tensor_parallel} x {bundle} "
                           f"(cluster resources: {ray.cluster_resources()})")
    return group


def place_instance(name: str, pool, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """Reserve one instance's bundles (one per rank, PACK) in a placement group of its own; raises
    ClusterError naming the instance and what it asked for when the cluster cannot hold them in time."""
    bundle = pool_bundle(pool)
    group = placement_group([dict(bundle) for _ in range(pool.tensor_parallel)], strategy="PACK",
                            name=f"magicserve-{name}")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ClusterError(f"{name}: cannot place {pool.tensor_parallel} x {bundle} within {timeout_s:g} s "
                           f"(cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()})")
    return group


@dataclass(frozen=True)
class _Launch:
    """How one instance's ranks start: its pool (the config its workers take), actor class and arguments, and
    its first bundle in the pool's placement group (rank r takes bundle ``first_bundle + r``)."""

    role: str
    pool: InstanceConfig
    actor_cls: object
    model: str
    args: Callable[[str], tuple]
    transfer: TransferConfig | None
    group: object
    first_bundle: int
    bundle: dict


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
        self._launches: dict[str, _Launch] = {}  # instance name -> how to start its ranks again
        self._groups: dict[str, object] = {}  # instance name -> its placement group
        self._next_index: dict[str, int] = {}  # role -> the number the next instance of the pool gets
        self._pools: dict[str, tuple] = {}  # role -> (pool config, actor class, model, args, transfer)
        self._store = None
        self.rendezvous: Rendezvous | None = None
        self.kv_store: MooncakeStoreService | None = None  # the store this cluster runs (kv_tiers.store)
        self._migration_pairs = 0  # migration channels formed (each under its own generation)
        self._started_ray = False
        # instances whose ranks are up: a restarted or added instance forms its KV channels with these, one
        # instance at a time (of two restarting together, the one up last forms the pair)
        self._up: set[str] = set()
        self._wiring = asyncio.Lock()

    # -- bring-up ---------------------------------------------------------------------------------

    def start(self, timeline: StartupTimeline | None = None) -> None:
        """Bring the pools up: Ray, placement, every worker started, KV channels formed; each phase timed
        into ``timeline`` when one is given."""
        timeline = timeline or StartupTimeline()
        with timeline.phase("ray"):
            self._init_ray(ray)
        model = self.config.model_path
        if not os.path.isdir(model):
            raise ClusterError(f"model.path: {model} is not a directory")
        self._check_parallelism(model)
        # the store where KV pairs and tensor-parallel groups form
        self._store, self.rendezvous = Rendezvous.host_store(self.config.kv_transfer.rendezvous_host)
        self._start_kv_store(timeline)
        if self.config.mode == "colocated":
            self._start_colocated(model, timeline)
        else:
            self._start_disaggregated(model, timeline)
        log.info("cluster up: %s", self.config.describe_pools())

    def _start_kv_store(self, timeline: StartupTimeline) -> None:
        """Start the cluster's KV store when the config asks for one without naming its master; every instance
        then connects to it."""
        tiers = self.config.kv_tiers
        store = tiers.store
        if not (tiers.enabled and store.enabled and not store.master_address):
            return
        with timeline.phase("kv store"):
            self.kv_store = MooncakeStoreService.start(store, self.config.kv_transfer.rendezvous_host,
                                                       node=ray.get_runtime_context().get_node_id())
        store = dataclasses.replace(store, master_address=self.kv_store.master_address)
        self.config = dataclasses.replace(self.config, kv_tiers=dataclasses.replace(tiers, store=store))

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode + self.colocated

    def _check_parallelism(self, model: str) -> None:
        """Every pool's tensor_parallel must split the model's heads and MLP evenly."""

        config = load_config(model)
        for role, pool in self.config.pools.items():
            try:
                TPShard(0, pool.tensor_parallel).check(config, f"{role}.tensor_parallel")
            except ValueError as err:
                raise ClusterError(str(err)) from None

    def _start_disaggregated(self, model: str, timeline: StartupTimeline) -> None:
        p, d, transfer = self.config.prefill, self.config.decode, self.config.kv_transfer
        pools = {"prefill": p, "decode": d}  # an instance may change role: it carries both pools' configs
        with timeline.phase("placement"):  # the groups placed, the actors asked for (they start meanwhile)
            self.prefill = self._start_pool("prefill", p, DisaggregatedActor, model,
                                            lambda name: (name, p.threads, transfer, "prefill", pools))
            self.decode = self._start_pool("decode", d, DisaggregatedActor, model,
                                           lambda name: (name, d.threads, transfer, "decode", pools), transfer)
        with timeline.phase("workers"):  # processes, imports, model load, KV pool, start-up profiling
            self._wait_ready()
        with timeline.phase("kv channels"):
            self._connect_all()

    def _start_colocated(self, model: str, timeline: StartupTimeline) -> None:
        c = self.config.colocated
        with timeline.phase("placement"):
            self.colocated = self._start_pool("colocated", c, ColocatedActor, model, lambda name: (name, c.threads))
        with timeline.phase("workers"):
            self._wait_ready()

    def _wait_ready(self) -> None:
        """Every rank up; every node they run on holding a segment of the cluster's store."""
        ray.get([i.handle.ping.remote() for i in self.instances]
                + [f.ping.remote() for fs in self.followers.values() for f in fs])
        if self.kv_store is not None:
            self.kv_store.cover(placement_nodes(self._groups.values()))

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
                     resources=dict(rc.resources) or None,
                     namespace=rc.namespace, include_dashboard=False, log_to_driver=True)
            self._started_ray = True

    def _start_pool(self, role: str, pool: InstanceConfig, actor_cls, model: str, args,
                    transfer: TransferConfig | None = None) -> list[Instance]:
        """Place every instance of the pool (all or none: a pool the cluster cannot hold is an error naming
        it) and start each instance's rank 0 (``actor_cls``, with ``model, pool, *args(name)``: the pool's
        section is its workers' config) and its followers."""
        self._pools[role] = (pool, ray_actor_class(actor_cls), model, args, transfer)
        names = [f"{role}-{i}" for i in range(pool.instances)]
        self._next_index[role] = pool.instances
        try:
            for name in names:
                self._groups[name] = place_instance(name, pool)
        except ClusterError:
            for name in names:
                group = self._groups.pop(name, None)
                if group is not None:
                    ray.util.remove_placement_group(group)
            raise ClusterError(f"{role}: cannot place {pool.instances} instances of {pool.tensor_parallel} x "
                               f"{pool_bundle(pool)} (cluster resources: {ray.cluster_resources()})") from None
        return [self._start_instance(name, role) for name in names]

    def _start_instance(self, name: str, role: str) -> Instance:
        """Start the ranks of instance ``name`` of pool ``role`` in its placement group; returns at once."""
        pool, actor_cls, model, args, transfer = self._pools[role]
        launch = _Launch(role, pool, actor_cls, model, args, transfer, self._groups[name], 0, pool_bundle(pool))
        inst = Instance(name, role, None)
        self._launches[name] = launch
        self._launch(inst, launch)
        return inst

    # -- resizing ---------------------------------------------------------------------------------

    async def add_instance(self, role: str, placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> Instance:
        """A new instance of pool ``role``, placed, its ranks up and (disaggregated) its KV channels formed
        with every live instance of the other pool: ready to take requests. Nothing is left behind when it
        fails (no room within ``placement_timeout_s``, a rank that does not come up): raises ClusterError."""
        if role not in self._pools:
            raise ClusterError(f"pool: {role!r} is not a pool of this cluster ({', '.join(self._pools)})")
        pool = self._pools[role][0]
        name = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        loop = asyncio.get_running_loop()
        self._groups[name] = await loop.run_in_executor(None, place_instance, name, pool, placement_timeout_s)
        inst = self._start_instance(name, role)
        try:
            await asyncio.wait_for(asyncio.gather(*(h.ping.remote() for h in self._ranks(inst))), READY_TIMEOUT_S)
            if self.kv_store is not None:
                await loop.run_in_executor(None, self.kv_store.cover, placement_nodes([self._groups[name]]))
            if self.config.mode == "disaggregated":
                await asyncio.wait_for(self.rewire(inst), self.config.kv_transfer.timeout_s * 4 + 60)
        except Exception as err:
            self._stop_instance(inst)
            raise ClusterError(f"{role} {name}: did not come up: {type(err).__name__}: {err}") from None
        getattr(self, role).append(inst)
        return inst

    def remove_instance(self, inst: Instance) -> None:
        """Stop every rank of ``inst`` and give its resources back (the router has let it go)."""
        pool = getattr(self, inst.role)
        if inst in pool:
            pool.remove(inst)
        self._stop_instance(inst)

    def _stop_instance(self, inst: Instance) -> None:
        self._up.discard(inst.name)
        for handle in self._ranks(inst):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
        group = self._groups.pop(inst.name, None)
        if group is not None:
            ray.util.remove_placement_group(group)
        self._launches.pop(inst.name, None)
        self.followers.pop(inst.name, None)

    def _launch(self, inst: Instance, launch: "_Launch") -> None:
        """Start every rank of ``inst`` (generation ``inst.generation``) in its bundles; returns at once."""

        t, gen = launch.pool.tensor_parallel, inst.generation
        suffix = f"-g{gen}" if gen else ""  # a dead actor's name may not be free yet

        def options(actor: str, rank: int) -> dict:
            return dict(name=f"magicserve-{actor}{suffix}", num_cpus=launch.bundle["CPU"],
                        num_gpus=launch.bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            launch.group, placement_group_bundle_index=launch.first_bundle + rank))

        host, port = self.rendezvous.host, self.rendezvous.port
        timeout = launch.pool.collective_timeout_s
        specs = [RankSpec(r, t, host, port, gen, timeout) for r in range(t)] if t > 1 else [None]
        inst.handle = launch.actor_cls.options(**options(inst.name, 0)).remote(
            launch.model, launch.pool, *launch.args(inst.name), tp=specs[0])
        follower_cls = ray_actor_class(RankFollowerActor)
        # a disaggregated instance's ranks may change role with it: they carry both pools' configs and the KV
        # transfer's (a decode rank receives its heads)
        pools, transfer = None, launch.transfer
        if self.config.mode == "disaggregated":
            pools, transfer = {"prefill": self.config.prefill, "decode": self.config.decode}, self.config.kv_transfer
        self.followers[inst.name] = [
            follower_cls.options(**options(f"{inst.name}-rank{r}", r)).remote(
                launch.role, launch.model, launch.pool, inst.name, launch.pool.threads, specs[r], transfer, pools)
            for r in range(1, t)]

    def _ranks(self, inst: Instance) -> list:
        return [inst.handle, *self.followers.get(inst.name, [])]

    async def restart(self, inst: Instance) -> None:
        """Replace every rank of ``inst`` (dead, hung or crashed) with fresh actors in the same bundles: a new
        generation, so its tensor-parallel group and KV channels form anew. Raises ClusterError once the
        instance has used its restarts or the new ranks do not come up."""

        if inst.restarts >= MAX_INSTANCE_RESTARTS:
            raise ClusterError(f"{inst.role} {inst.name}: restarted {inst.restarts} times already; "
                               "left out of service")
        launch = self._launches[inst.name]
        self._up.discard(inst.name)
        for handle in self._ranks(inst):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
        inst.generation += 1
        inst.restarts += 1
        self._launch(inst, launch)
        try:
            await asyncio.wait_for(asyncio.gather(*(h.ping.remote() for h in self._ranks(inst))),
                                   READY_TIMEOUT_S)
        except Exception as err:
            raise ClusterError(f"{inst.role} {inst.name}: its new ranks did not come up: {err}") from None
        if self.kv_store is not None:  # Ray may have placed the group again on another node
            nodes = placement_nodes([launch.group])
            await asyncio.get_running_loop().run_in_executor(None, self.kv_store.cover, nodes)
        await self.rewire(inst)

    def switch_problem(self) -> str | None:
        """Why instances cannot change role between this cluster's pools (None: they can)."""
        if self.config.mode != "disaggregated":
            return f"a {self.config.mode} cluster has one pool"
        p, d = self.config.prefill, self.config.decode
        if p.tensor_parallel != d.tensor_parallel:
            return (f"prefill instances have {p.tensor_parallel} tensor-parallel ranks and decode instances "
                    f"{d.tensor_parallel}: an instance changes role only between pools of one shape")
        if pool_bundle(p) != pool_bundle(d):
            return (f"prefill and decode instances hold different resources ({pool_bundle(p)} against "
                    f"{pool_bundle(d)}): an instance changes role only between pools of one shape")
        return None

    async def switch_role(self, inst: Instance, role: str) -> None:
        """Make ``inst`` (drained by the router) an instance of pool ``role`` in its own process and placement
        group: its worker changes role (``DisaggregatedActor.become``, the weights kept in memory), it takes a new
        generation (its KV channels form anew; its counters restart, carried over by the metrics), and it forms
        the new role's KV channels with every live instance of the other pool. Raises ClusterError when the pools
        cannot exchange instances (``switch_problem``) or the worker refused; once the worker has switched, the
        instance is in its new pool whatever the channels' formation gives (``rewire`` raises when none formed)."""
        problem = self.switch_problem()
        if problem is not None:
            raise ClusterError(f"{inst.name}: {problem}")
        if role not in self._pools or role == inst.role:
            raise ClusterError(f"role: {inst.name} is a {inst.role} instance; it can become "
                               f"{' or '.join(r for r in self._pools if r != inst.role)}")
        try:
            deadline = time.monotonic() + self.config.kv_transfer.timeout_s
            while await inst.handle.holds_work.remote() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # drained by the router; the worker lets go a moment later
            await asyncio.wait_for(inst.handle.become.remote(role), READY_TIMEOUT_S)
        except Exception as err:
            raise ClusterError(f"{inst.role} {inst.name}: did not become a {role} instance: "
                               f"{type(err).__name__}: {err}") from None
        getattr(self, inst.role).remove(inst)
        getattr(self, role).append(inst)
        pool, _, _, args, transfer = self._pools[role]
        self._launches[inst.name] = dataclasses.replace(self._launches[inst.name], role=role, pool=pool, args=args,
                                                        transfer=transfer)
        inst.role = role
        inst.generation += 1
        self._up.discard(inst.name)
        await self.rewire(inst)

    async def check_ranks(self, inst: Instance) -> None:
        """Raise if a follower rank of ``inst`` died or has not answered within the pool's
        ``collective_timeout_s`` (hung). Rank 0 is watched by the router's polls."""
        followers = self.followers.get(inst.name, [])
        if followers:
            timeout = self._launches[inst.name].pool.collective_timeout_s
            try:
                await asyncio.wait_for(asyncio.gather(*(f.ping.remote() for f in followers)), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"a rank did not answer within collective_timeout_s ({timeout:g} s)") from None

    # -- KV channels ------------------------------------------------------------------------------

    def _pair_calls(self, prefill: Instance, decode: Instance):
        """Every rank of both instances forms its own channels (the KV of each head moves rank to rank)."""
        gen = prefill.generation + decode.generation
        host, port = self.rendezvous.host, self.rendezvous.port
        p_tp, d_tp = self.config.prefill.tensor_parallel, self.config.decode.tensor_parallel
        return ([h.connect.remote(decode.name, host, port, gen, d_tp) for h in self._ranks(prefill)]
                + [h.connect.remote(prefill.name, host, port, gen, p_tp) for h in self._ranks(decode)])

    def _connect_all(self) -> None:

        refs = [r for p in self.prefill for d in self.decode for r in self._pair_calls(p, d)]
        ray.get(refs, timeout=self.config.kv_transfer.timeout_s * 4 + 60)
        self._up.update(i.name for i in self.instances)

    async def rewire(self, inst: Instance) -> None:
        """Form every KV channel of a restarted or added instance (its ranks up) with the peers whose ranks
        are up. A peer that fails the formation is left to its own restart, which forms the pair again;
        raises ClusterError when every pair failed."""
        async with self._wiring:
            self._up.add(inst.name)
            peers = [p for p in (self.decode if inst.role == "prefill" else self.prefill) if p.name in self._up]
            timeout = self.config.kv_transfer.timeout_s * 4 + 60

            async def pair(peer: Instance) -> None:
                p, d = (inst, peer) if inst.role == "prefill" else (peer, inst)
                await asyncio.wait_for(asyncio.gather(*self._pair_calls(p, d)), timeout)

            results = await asyncio.gather(*(pair(peer) for peer in peers), return_exceptions=True)
        failed = [(peer, r) for peer, r in zip(peers, results) if isinstance(r, BaseException)]
        for peer, err in failed:
            log.warning("%s %s: no KV channels with %s: %s: %s", inst.role, inst.name, peer.name,
                        type(err).__name__, err)
        if peers and len(failed) == len(peers):
            self._up.discard(inst.name)
            raise ClusterError(f"{inst.role} {inst.name}: no KV channel formed with any peer")

    async def connect_migration_pair(self, source: Instance, destination: Instance) -> None:
        """Form the channels live migration moves requests from decode ``source`` to ``destination`` over:
        each source rank to the destination ranks holding its heads (each formation under a fresh
        generation, so a broken channel re-forms cleanly)."""
        self._migration_pairs += 1
        gen, host, port = self._migration_pairs, self.rendezvous.host, self.rendezvous.port
        tp = self.config.decode.tensor_parallel
        await asyncio.wait_for(asyncio.gather(
            *(h.connect_migration.remote(destination.name, host, port, gen, tp) for h in self._ranks(source)),
            *(h.connect.remote(source.name, host, port, gen, tp) for h in self._ranks(destination))),
            self.config.kv_transfer.timeout_s * 4 + 60)

    # -- status and shutdown ----------------------------------------------------------------------

    async def statuses(self) -> list[dict]:
        """Every instance's ``status()`` (zeros where it does not answer within 5 s), with ``alive`` and
        ``generation`` (how many times it was replaced: its counters restarted at 0 each time)."""
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
            st["generation"] = inst.generation
            out.append(st)
        return out

    async def drain_pass_logs(self) -> list[dict]:
        """Every live instance's timed passes since the last drain (``modeling/pass_log.py``): per instance
        ``name``, ``role``, ``records`` and ``dropped`` (passes its log could not keep)."""
        live = [inst for inst in self.instances if inst.alive]
        logs = await asyncio.gather(*(asyncio.wait_for(inst.handle.pass_log_counted.remote(), 30.0) for inst in live))
        return [{"name": inst.name, "role": inst.role, **log} for inst, log in zip(live, logs)]

    def shutdown(self) -> None:

        for handle in [h for inst in self.instances for h in self._ranks(inst)]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        for g in self._groups.values():
            try:
                ray.util.remove_placement_group(g)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()
        if self.kv_store is not None:
            self.kv_store.stop()
            self.kv_store = None
