"""The CUDA-graph stand-in replays what a graph would: a function whose replay would differ from
its capture on a GPU (a host value it reads, a tensor it makes from host values, a buffer
swapped under it, a generator the graph does not know) fails on a CPU, naming the op."""

import pytest
import torch

from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.backends.graph_trace import GraphReplayError, OpTrace, check_replay
from metrale.runtime.models.layers import MoE, capturable
from metrale.runtime.backends.host_reads import HostRead, forbid_host_reads
from metrale.runtime.spec.sampling import probs_on_device


def _captured(fn):
    graphs = EagerGraphs()
    graph, outs = graphs.capture(fn)
    return graphs, graph, outs


def test_a_replay_of_the_same_ops_on_the_same_memory_passes_and_updates_the_outputs():
    buf = torch.arange(4.0)
    graphs, graph, (out,) = _captured(lambda: ((buf * 2).sum(0, keepdim=True),))
    for i in range(10):
        buf.add_(1)  # values may change: a graph reads its buffers afresh
        graphs.replay(graph)
        assert out.item() == 2 * (buf.sum().item())
    assert graphs.replays == 10


def test_a_python_value_read_at_each_call_fails_the_replay_where_it_changes():
    buf, state = torch.ones(4), {"scale": 2.0}
    graphs, graph, _ = _captured(lambda: (buf * state["scale"],))
    graphs.replay(graph)
    state["scale"] = 3.0
    with pytest.raises(GraphReplayError, match=r"aten\.mul\.Tensor, argument 1 \(other\): 2\.0 at capture, 3\.0 now.*froze"):
        graphs.replay(graph)


def test_a_tensor_made_from_changing_host_values_fails_and_a_constant_one_passes():
    buf, state = torch.zeros(3), {"xs": [1.0, 2.0, 3.0]}
    graphs, graph, _ = _captured(lambda: (buf + torch.tensor(state["xs"]),))
    graphs.replay(graph)  # the same values: what the graph holds
    state["xs"] = [1.0, 2.0, 4.0]
    with pytest.raises(GraphReplayError, match=r"lift_fresh.*host values \(1\.0, 2\.0, 3\.0\) at capture, "
                                               r"host values \(1\.0, 2\.0, 4\.0\) now"):
        graphs.replay(graph)
    # the nucleus filter writes a constant into a mask (`t[..., 0] = True`): the same every time
    logits, temperature, top_p = torch.randn(2, 16), torch.full((1,), 0.7), torch.full((1,), 0.9)
    graphs, graph, _ = _captured(lambda: (probs_on_device(logits, temperature, top_p),))
    for _ in range(3):
        graphs.replay(graph)


def test_a_buffer_swapped_under_the_function_fails_the_replay():
    class Holder:
        buf = torch.ones(4)

    graphs, graph, _ = _captured(lambda: (Holder.buf + 1,))
    graphs.replay(graph)
    Holder.buf = torch.ones(4)  # same values, other memory: the graph reads the old one
    with pytest.raises(GraphReplayError, match="memory is not capture's"):
        graphs.replay(graph)


def test_a_shape_from_the_host_fails_the_replay():
    buf, state = torch.arange(8.0), {"n": 4}
    graphs, graph, _ = _captured(lambda: (buf[:state["n"]].sum(0, keepdim=True),))
    state["n"] = 5
    with pytest.raises(GraphReplayError, match=r"aten\.slice\.Tensor, argument 3 \(end\): 4 at capture, 5 now"):
        graphs.replay(graph)


def test_a_python_loop_over_a_host_count_fails_the_replay():
    buf, state = torch.ones(2), {"n": 2}

    def fn():
        x = buf
        for _ in range(state["n"]):
            x = x + 1
        return (x,)

    graphs, graph, _ = _captured(fn)
    state["n"] = 3
    with pytest.raises(GraphReplayError, match=r"3 ops where the capture ran 2 \(they part at op 2\)"):
        graphs.replay(graph)


def test_draws_come_from_a_registered_generator_and_an_unregistered_one_is_refused():
    registered = torch.Generator().manual_seed(1)
    graphs = EagerGraphs()
    graph, (out,) = graphs.capture(lambda: (torch.rand(3, generator=registered),), generators=(registered,))
    draws = set()
    for seed in (5, 6, 5):
        registered.manual_seed(seed)  # a request's seed: the same generator, a new state
        graphs.replay(graph)
        draws.add(tuple(out.tolist()))
    assert len(draws) == 2
    other = torch.Generator().manual_seed(1)
    with pytest.raises(GraphReplayError, match="not registered with the graph"):
        graphs.capture(lambda: (torch.rand(3, generator=other),), generators=(registered,))


def test_replays_are_checked_first_then_periodically():
    """The first CHECK_FIRST replays and every CHECK_EVERY-th after them run under the check."""
    buf, state = torch.ones(2), {"scale": 1.0}
    graphs, graph, _ = _captured(lambda: (buf * state["scale"],))
    first, every = EagerGraphs.CHECK_FIRST, EagerGraphs.CHECK_EVERY
    for _ in range(first):
        graphs.replay(graph)
    state["scale"] = 2.0
    for _ in range(first + 1, every):
        graphs.replay(graph)  # unchecked: a GPU would have replayed 1.0 here
    with pytest.raises(GraphReplayError):
        graphs.replay(graph)  # the CHECK_EVERY-th


def test_the_trace_names_memory_by_the_op_that_made_it():
    """Intermediates are told by the op that made them, whatever address they got, so two
    calls of the same function compare equal; buffers from before the call by address."""
    w = torch.randn(4, 4)

    def fn():
        x = w @ w
        y = x.t().contiguous()
        return (y.to(torch.float64) + x,)  # `to` may alias; here it copies

    traces = []
    for _ in range(2):
        with OpTrace() as t:
            fn()
        traces.append(t)
    check_replay(*traces)
    makers = [d[0] for _, args, _ in traces[0].ops for d in args if type(d) is tuple and len(d) == 5]
    assert makers[:2] == [w.untyped_storage().data_ptr()] * 2 and (0, 0) in makers


def _moe() -> MoE:
    from metrale.runtime.models.configs import DecoderConfig

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64)
    torch.manual_seed(0)
    moe = MoE(cfg).eval()
    moe.pack()
    return moe


def test_a_captured_one_row_moe_takes_the_gpus_path():
    """On a CPU a one-row MoE step reads its routing on the host (its selected experts only);
    a GPU's graph cannot, and what a graph captures (`capturable`, as the graph target's and the
    iterations' models are) runs what the GPU runs: every expert, weighted."""
    moe = _moe()
    x = torch.randn(1, 1, 32)
    with torch.inference_mode():
        with pytest.raises(HostRead):
            with forbid_host_reads("a one-row step"):
                eager = moe(x)
        eager = moe(x)
        capturable(moe)
        with forbid_host_reads("a one-row step in a graph"):
            graphed = moe(x)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)
    graphs, graph, (out,) = _captured(lambda: (moe(x),))
    x.copy_(torch.randn(1, 1, 32))  # other routing, the same ops
    graphs.replay(graph)
    with torch.inference_mode():
        torch.testing.assert_close(out, moe(x), rtol=1e-5, atol=1e-6)


def test_a_stand_in_for_measuring_checks_nothing():
    buf, state = torch.ones(2), {"scale": 1.0}
    graphs = EagerGraphs(check=False)
    graph, (out,) = graphs.capture(lambda: (buf * state["scale"],))
    state["scale"] = 2.0
    graphs.replay(graph)  # what the function does now, unchecked
    assert out.tolist() == [2.0, 2.0]


def test_what_the_call_returns_is_checked():
    """Two results made alike, the call returning one or the other: a graph's outputs stay the
    ones it wrote at capture."""
    buf, state = torch.ones(2), {"first": True}

    def fn():
        y, z = buf + 1, buf + 2
        return (y if state["first"] else z,)

    graphs, graph, _ = _captured(fn)
    graphs.replay(graph)
    state["first"] = False
    with pytest.raises(GraphReplayError, match=r"the call's return, output 0: a tensor of op 1's output 0 .* "
                                               r"where the capture read a tensor of op 0's output 0"):
        graphs.replay(graph)


def test_a_host_read_fails_the_capture():
    buf = torch.ones(3)
    with pytest.raises(HostRead, match="captured"):
        _captured(lambda: (buf * buf.sum().item(),))


def test_a_function_that_dispatches_nothing_is_refused():
    with pytest.raises(GraphReplayError, match="dispatched no op"):
        _captured(lambda: ())


def test_nan_scalars_are_the_same_value_every_call():
    buf = torch.zeros(3)
    mask = torch.tensor([True, False, True])
    graphs, graph, (out,) = _captured(lambda: (buf.masked_fill(mask, float("nan")) + torch.tensor([float("nan"), 0.0, 1.0]),))
    graphs.replay(graph)
    assert out.isnan().tolist() == [True, False, True]


def test_a_keyword_and_a_defaulted_argument_are_named():
    xs, state = [torch.ones(2, 2)] * 2, {"dim": 1}
    graphs, graph, _ = _captured(lambda: (torch.cat(xs, dim=state["dim"]),))
    state["dim"] = 0  # aten leaves a default out: one argument fewer
    with pytest.raises(GraphReplayError, match=r"aten\.cat\.default: 1 arguments where the capture had 2; "
                                               r"they part at argument 1 \(dim: its default in one of them\)"):
        graphs.replay(graph)
    draws = torch.Generator().manual_seed(0)
    graphs = EagerGraphs()
    graph, _ = graphs.capture(lambda: (torch.ones(3).uniform_(0.0, 1.0, generator=draws),), generators=(draws,))
    graphs.replay(graph)
