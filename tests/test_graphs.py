"""Level 8's step recorded once as a CUDA graph and replayed (level8_framework/graphs.py): the same bits as the eager
step at every step, with either optimizer, for both networks, across epochs, a learning rate changed between them, an
epoch's last short batch, the state loaded between steps as the lockstep loads it, and the state forgotten; what a
recording refuses (host work, an optimizer without its state); and no device memory left behind.

Each test runs on the GPU (skipped without one; `make test-gpu` runs them) and over the stand-in library
(tests/ops_stand_in.py), which records the calls made while a step is recorded and replays them, and refuses what
CUDA's stream capture refuses: the graph's Python side is tested on every machine.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from common.levels import level
from common.nets import get
from strided_stand_in import backend as stand_in_backend

pytestmark = pytest.mark.level8

GPU_DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"), pytest.param("stand-in", id="cuda-stand-in")]


@pytest.fixture(params=GPU_DEVICES)
def gpu(request, monkeypatch) -> str:
    """"cuda" on the GPU, or over the stand-in."""
    from ops_stand_in import device_under_test

    return device_under_test(request, monkeypatch, stand_in_backend)


def models(network: str, optimizer: str, hidden: int = 16, seed: int = 3):
    """An eager model and a graphed one of level 8 on the GPU, from the same parameters."""
    net = get(network)
    params = net.network.init_params(seed, hidden)
    make = level(8).load(net)
    return (make(params, device="cuda", optimizer=optimizer),
            make(params, device="cuda", optimizer=optimizer, step="graph"))


def assert_same_bits(eager, graphed) -> None:
    """Parameters, and the optimizer's state (step counts and moments), equal bit for bit."""
    for name, value in eager.state_dict().items():
        np.testing.assert_array_equal(graphed.state_dict()[name], value, err_msg=name)
    ours, theirs = graphed.optimizer_state(), eager.optimizer_state()
    assert ours.keys() == theirs.keys()
    for name, state in theirs.items():
        for key, value in state.items():
            np.testing.assert_array_equal(ours[name][key], value, err_msg=f"{name}.{key}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("network", ["mlp", pytest.param("lenet", marks=pytest.mark.lenet)])
def test_a_replayed_step_is_the_eager_step_bit_for_bit(gpu, mnist, network, optimizer):
    """Three epochs of 56 images in batches of 16 (a short last batch, run eagerly), the learning rate changed before
    the third: every loss, parameter and moment as the eager step's, bit for bit; the model says it replayed."""
    eager, graphed = models(network, optimizer)
    X, y = mnist[0][:56], mnist[1][:56]
    for epoch, lr in enumerate([0.05, 0.05, 0.02]):
        order = np.random.default_rng(epoch).permutation(len(X))
        np.testing.assert_array_equal(graphed.train_epoch(X, y, 16, lr, order), eager.train_epoch(X, y, 16, lr, order))
        assert_same_bits(eager, graphed)
    assert graphed._replays == 3 * 3 - 1  # the first step of all is eager: it makes the state the graph updates
    assert graphed.variant() == {**eager.variant(), "step": "graph"}
    assert "step" not in eager.variant()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_lockstep_loads_between_steps_keep_the_graph_and_forgetting_the_state_records_again(gpu, mnist, optimizer):
    """The lockstep's loads before each one-step epoch (parameters, the optimizer's state) write into the arrays the
    graph updates: it replays on; the state forgotten (a timed run's restart), the next step is eager and makes it
    again, and the one after is recorded again. Bit for bit as the eager model all along."""
    eager, graphed = models("mlp", optimizer)
    X, y = mnist[0][:64], mnist[1][:64]
    eager.train_epoch(X, y, 16, 0.05)
    graphed.train_epoch(X, y, 16, 0.05)
    recorded = graphed._graph
    for k in range(4):
        params, state = eager.state_dict(), eager.optimizer_state()
        for model in (eager, graphed):
            model.load_state_dict(params)
            model.load_optimizer_state(state)
        batch = np.arange(16 * k, 16 * k + 16)
        np.testing.assert_array_equal(graphed.train_epoch(X, y, 16, 0.05, batch),
                                      eager.train_epoch(X, y, 16, 0.05, batch))
        assert_same_bits(eager, graphed)
    assert graphed._graph is recorded and graphed._replays == 3 + 4
    for model in (eager, graphed):
        model.load_optimizer_state({})
    np.testing.assert_array_equal(graphed.train_epoch(X, y, 16, 0.05), eager.train_epoch(X, y, 16, 0.05))
    assert_same_bits(eager, graphed)
    assert graphed._graph is not recorded if optimizer == "adam" else graphed._graph is recorded


def test_a_replay_leaves_each_parameter_its_gradient(gpu, mnist):
    """After a replay each parameter's .grad is that step's gradient, as after an eager step."""
    eager, graphed = models("mlp", "sgd")
    X, y = mnist[0][:32], mnist[1][:32]
    eager.train_epoch(X, y, 16, 0.05)
    graphed.train_epoch(X, y, 16, 0.05)
    for p, q in zip(eager.net.parameters(), graphed.net.parameters()):
        np.testing.assert_array_equal(q.grad.numpy(), p.grad.numpy())


def test_a_step_recorded_with_sgd_momentum_through_the_framework(gpu, mnist):
    """The framework's own API, as a student writes it: a network, SGD with momentum, one eager step, then the step
    recorded on static input buffers and replayed; a changed learning rate holds at the next replay. Bit for bit as
    the same steps taken eagerly."""
    from level8_framework import nn, optim
    from level8_framework.cuda import backend
    from level8_framework.graphs import StepGraph
    from level8_framework.mlp import mlp
    from level8_framework.tensor import from_backend

    be, params = backend(), get("mlp").network.init_params(1, 16)
    X, y = mnist[0][:96], mnist[1][:96].astype(np.int32)
    nets = []
    for _ in range(2):
        net = mlp(16).to("cuda")
        net.load_state_dict(params)
        nets.append((net, optim.SGD(net.parameters(), lr=0.05, momentum=0.9)))
    loss_fn = nn.CrossEntropyLoss()

    def step(net, opt, x, labels):
        loss = loss_fn(net(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    x, labels = be.empty((16, X.shape[1])), be.empty((16,), "int")
    losses = {0: [], 1: []}
    for k in range(6):
        rows = slice(16 * k, 16 * k + 16)
        for which, (net, opt) in enumerate(nets):
            opt.lr = 0.05 if k < 4 else 0.01
            if which == 0 or k == 0:
                loss = step(net, opt, from_backend(be.from_numpy(X[rows]), be), be.from_numpy(y[rows], "int"))
                losses[which].append(loss.item())
                continue
            if k == 1:
                graph = StepGraph(be, lambda: step(net, opt, from_backend(x, be), labels))
            be.assign(x, X[rows])
            be.assign(labels, y[rows])
            graph.replay()
            losses[which].append(float(be.to_numpy(graph.loss)))
    assert losses[0] == losses[1]
    for p, q in zip(nets[0][0].parameters(), nets[1][0].parameters()):
        np.testing.assert_array_equal(q.numpy(), p.numpy())


def test_a_recording_refuses_what_a_graph_cannot_hold_and_leaves_the_backend_as_it_was(gpu, mnist):
    """A step that waits for the GPU (.item()) or records before the optimizer has its state is refused with the
    reason, and the backend goes on eagerly afterwards: nothing is left recording, no memory held back."""
    from level8_framework import Tensor, optim
    from level8_framework.cuda import backend
    from level8_framework.graphs import StepGraph
    from level8_framework.mlp import mlp

    be = backend()
    net = mlp(8).to("cuda")
    x = Tensor(mnist[0][:4], device="cuda")

    def host_work():
        net.zero_grad()
        loss = net(x).sum()
        loss.backward()
        loss.item()
        return loss

    with pytest.raises(Exception, match="capturing|not permitted|capture"):
        StepGraph(be, host_work)
    assert be.recording is None and be.held_back == []
    adam = optim.Adam(net.parameters(), lr=0.01)

    def adam_step():
        loss = net(x).sum()
        adam.zero_grad()
        loss.backward()
        adam.step()
        return loss

    with pytest.raises(RuntimeError, match="take one step before recording"):
        StepGraph(be, adam_step)
    assert be.recording is None
    adam_step()  # eagerly, as before
    assert all(adam.has_state(i) for i in range(len(adam.params)))


def test_ctrl_c_while_a_step_is_recorded_leaves_the_backend_eager_and_its_memory_given_back(gpu, mnist):
    """A KeyboardInterrupt raised inside the recorded step (Ctrl-C) stops the recording: it reaches the caller, nothing
    is left recording or held back, no parameter keeps a gradient the recording never computed, the arrays made
    meanwhile go back with the arena, and the model trains on (a step op by op, then replays); bit for bit as the
    eager model."""
    from level8_framework import cuda

    eager, graphed = models("mlp", "sgd")
    X, y = mnist[0][:48], mnist[1][:48]
    for model in (eager, graphed):
        model.train_epoch(X[:16], y[:16], 16, 0.05)  # op by op: the state, and cuBLAS set up
    gc.collect()
    before = cuda.backend().buffers()
    interrupted = graphed.optimizer.step

    def ctrl_c():
        raise KeyboardInterrupt

    graphed.optimizer.step = ctrl_c  # pressed while the step is recorded, after its forward and backward
    with pytest.raises(KeyboardInterrupt):
        graphed.train_epoch(X[16:32], y[16:32], 16, 0.05)
    graphed.optimizer.step = interrupted
    assert cuda.backend().recording is None and cuda.backend().held_back == [] and graphed._graph is None
    assert all(p.grad is None for p in graphed.net.parameters())
    gc.collect()
    assert cuda.backend().buffers() <= before
    np.testing.assert_array_equal(graphed.train_epoch(X, y, 16, 0.05), eager.train_epoch(X, y, 16, 0.05))
    assert_same_bits(eager, graphed)
    assert graphed._replays == 3 - 1  # the first step after the interruption op by op (no gradients), then replays


def test_an_arena_too_small_is_doubled_until_the_step_fits(gpu, mnist, monkeypatch):
    """The step recorded again on a larger arena until its arrays fit: the same bits."""
    from level8_framework import graphs

    monkeypatch.setattr(graphs, "FIRST_ARENA", 512)
    eager, graphed = models("mlp", "adam")
    X, y = mnist[0][:48], mnist[1][:48]
    np.testing.assert_array_equal(graphed.train_epoch(X, y, 16, 0.05), eager.train_epoch(X, y, 16, 0.05))
    assert_same_bits(eager, graphed)
    assert graphed._graph.arena.nbytes > 512


def test_graphed_models_leave_no_device_memory(gpu, mnist):
    """The arena, the graph's buffers and the memory held back while recording all go back: the library's count of
    its buffers is where it was after 50 graphed models, each trained and dropped."""
    from level8_framework import cuda

    X, y = mnist[0][:48], mnist[1][:48]
    gc.collect()
    before = cuda.backend().buffers()
    for i in range(50):
        model = models("mlp", "adam" if i % 2 else "sgd", hidden=8)[1]
        model.train_epoch(X, y, 16, 0.01)
        assert model._replays == 2
    del model
    gc.collect()
    assert cuda.backend().buffers() == before


def test_a_graph_is_asked_for_on_the_gpu_only():
    with pytest.raises(ValueError, match="device='cuda'"):
        level(8).load()(get("mlp").network.init_params(0, 8), device="cpu", step="graph")
    with pytest.raises(ValueError, match="step must be one of"):
        level(8).load()(get("mlp").network.init_params(0, 8), step="lazy")

