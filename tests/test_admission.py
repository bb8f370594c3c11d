"""Admission by priority: higher priority waiters get the next free slot; cancelled waiters never hold one."""

import asyncio

import pytest

from controller.admission import PriorityGate


def test_waiters_are_served_by_priority_then_arrival():
    async def scenario():
        gate = PriorityGate(1)
        await gate.acquire()
        order = []

        async def waiter(name, priority):
            await gate.acquire(priority)
            order.append(name)

        tasks = [asyncio.create_task(waiter(n, p)) for n, p in [("low", 0), ("high", 5), ("low2", 0), ("mid", 1)]]
        await asyncio.sleep(0)
        assert gate.locked() and gate.waiting == 4
        for _ in range(4):
            gate.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order, gate

    order, gate = asyncio.run(scenario())
    assert order == ["high", "mid", "low", "low2"]
    gate.release()
    assert not gate.locked()


def test_cancelled_waiter_passes_its_slot_on():
    async def scenario():
        gate = PriorityGate(1)
        await gate.acquire()
        gone = asyncio.create_task(gate.acquire(9))
        stays = asyncio.create_task(gate.acquire(0))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        gate.release()  # the cancelled high-priority waiter is skipped
        await asyncio.wait_for(stays, 1)
        assert gate.locked() and gate.waiting == 0
        gate.release()
        assert not gate.locked()

    asyncio.run(scenario())


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        PriorityGate(0)
