"""``summary()`` is strict JSON: the residual phase has no start offset (it was ``Infinity``)."""

from __future__ import annotations

import json

import torch


def test_summary_is_strict_json(mem_tracer):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = mem_tracer(model=model, optimizer=opt, flush_every_n_steps=1)
    for _ in range(5):
        with tracer.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    tracer.flush()
    tracer.finish()
    summary = tracer.summary()
    assert summary["steps"] == 5
    assert "residual" in summary["phases"]
    json.dumps(summary, allow_nan=False)  # raises ValueError on NaN/Infinity
