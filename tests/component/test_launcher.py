"""The local launcher on real engine processes (sim backend): it starts replicas into
the supervised list after the fixed engines, and drains the least busy one first,
taking it out of supervision before it stops, so its exit is no crash to restart."""

from __future__ import annotations

import asyncio

from llmesh.cli.launcher import EngineLauncher
from llmesh.cli.up import MeshSpec, plan
from llmesh.rpc.health import health_status
from llmesh.testing import free_layout

MODEL = "sim-launch"


async def test_starts_replicas_and_drains_the_least_busy_first(tmp_path, real_model_dir):
    layout = free_layout(n_engines=3)
    spec = MeshSpec(layout=layout, engines=["sim"], model_dir=real_model_dir, log_dir=tmp_path, grace_s=2.0)
    children = plan(spec)
    fixed = len(children)
    launcher = EngineLauncher(spec, children, {MODEL: "sim"}, say=lambda line: None)
    try:
        assert launcher.reconcile({MODEL: 2, "not-scaled": 5})
        names = [c.name for c in launcher.replicas(MODEL)]
        assert names == ["engine-1", "engine-2"]                  # engine-0 is the fixed one's
        assert [c.name for c in children[fixed:]] == names          # supervised like the rest
        for c in launcher.replicas(MODEL):
            assert c.env["LLMESH_ENGINE_MODEL"] == MODEL and c.env["LLMESH_ENGINE_ROUTE_AWAY_S"] == "0.5"

        async def serving(address: str) -> bool:
            for _ in range(200):
                if await health_status(address, timeout_s=0.5) == "SERVING":
                    return True
                await asyncio.sleep(0.1)
            return False

        assert all([await serving(c.address) for c in launcher.replicas(MODEL)])
        assert not launcher.reconcile({MODEL: 2})                  # already there
        busy_one, idle_one = launcher.replicas(MODEL)
        assert launcher.reconcile({MODEL: 1}, busy={busy_one.name: 3, idle_one.name: 0})
        assert launcher.replicas(MODEL) == [busy_one] and idle_one not in children
        await launcher.close()
        assert idle_one.proc.returncode == 0                        # drained, not killed
        assert busy_one.alive()
        launcher.reconcile({MODEL: 2})
        assert [c.name for c in launcher.replicas(MODEL)] == ["engine-1", "engine-2"]  # the index is reused
    finally:
        launcher.reconcile({MODEL: 0})
        await launcher.close()
    assert launcher.replicas(MODEL) == [] and len(children) == fixed
