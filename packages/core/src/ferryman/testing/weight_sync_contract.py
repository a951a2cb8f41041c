"""Contract every WeightSync transport passes. Subclass and provide fixtures ``transport`` (a
WeightSync) and ``make_engines`` (``make_engines(k) -> list[EngineHandle]`` of started engines
whose weights can be read back with ``read_weights(handle) -> dict[str, Tensor]``, given as the
fixture ``read_weights``) and ``weights`` (list of (name, tensor) the engines accept)."""

from __future__ import annotations

import torch

from ferryman.protocols import WeightSync


def _buckets(weights, per_bucket: int):
    for i in range(0, len(weights), per_bucket):
        yield weights[i : i + per_bucket]


class WeightSyncContract:
    async def test_is_a_weight_sync(self, transport):
        assert isinstance(transport, WeightSync)

    async def test_every_engine_gets_identical_weights(self, transport, make_engines, weights, read_weights):
        engines = await make_engines(2)
        metrics = await transport.transfer(_buckets(weights, 1), engines, version=1)
        assert isinstance(metrics, dict)
        for e in engines:
            got = await read_weights(e)
            for name, t in weights:
                assert torch.equal(got[name], t), f"{e.name}: {name} differs"

    async def test_bad_bucket_fails_without_partial_load(self, transport, make_engines, weights, read_weights):
        engines = await make_engines(1)
        before = {k: v.clone() for k, v in (await read_weights(engines[0])).items()}
        bad = [("no.such.weight", torch.zeros(3))]
        try:
            await transport.transfer(iter([bad]), engines, version=2)
        except Exception:  # noqa: BLE001 - any clear error is fine
            pass
        else:
            raise AssertionError("an unknown weight name must fail the transfer")
        after = await read_weights(engines[0])
        for k in before:
            assert torch.equal(before[k], after[k])
