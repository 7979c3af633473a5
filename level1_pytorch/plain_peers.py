"""The peers written plainly, apart from the harness: what a PyTorch user writes for speed, in a page of code.

    python -m common.harness.peers --check results/h100/chapter              # a training preset's peer rows
    python -m common.harness.peers --check results/h100/lenet-inference      # make infer's PyTorch rows

The harness's peers (peers.py, common/harness/serving.py) are classes that fit the level contract, so that they are verified
like any level. This file shares none of their code: nn.Sequential networks, a training loop, a CUDA graph captured
once on static buffers, torch.compile. Each is timed the way the harness times its row (training: one untimed epoch,
then each epoch timed, the median; serving: p50 of single calls, each waited for), and --check compares the two: a
harness row more than TOLERANCE from its plain twin, slower or faster, fails, since then one of them is not the
code its name says.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TOLERANCE = 1.15  # the harness's row and its plain twin, measured minutes apart on one GPU, agree within this ratio


def sequential(network: str, params: dict[str, np.ndarray], hidden: int | None = None) -> nn.Sequential:
    """The network as nn.Sequential on the GPU, with these weights (PyTorch's names, in order)."""
    if network == "mlp":
        layers = [nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10)]
    else:
        layers = [nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5),
                  nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84),
                  nn.ReLU(), nn.Linear(84, 10)]
    net = nn.Sequential(*layers).cuda()
    with torch.no_grad():
        for p, value in zip(net.parameters(), params.values()):
            p.copy_(torch.from_numpy(value))
    return net


# ---- training: an epoch of SGD steps over the data set on the GPU ----


def eager_epoch(net, X, y, batches, lr):
    """The plain loop: one step per batch, the losses kept on the GPU and read once."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)

    def epoch():
        losses = torch.empty(len(batches), device="cuda")
        for step, index in enumerate(batches):
            loss = F.cross_entropy(net(X[index]), y[index])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[step] = loss.detach()
        return losses.cpu()

    return epoch


def graph_epoch(net, X, y, batches, lr, compiled: bool = False):
    """The whole step - the batch's rows picked by a step counter on the GPU, forward, backward, update, the loss
    stored - captured once as a CUDA graph on static buffers; an epoch replays it once per step. compiled: the
    loss by torch.compile, the update PyTorch's fused SGD."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, fused=compiled)
    loss_of = torch.compile(lambda xb, yb: F.cross_entropy(net(xb), yb), dynamic=False) if compiled else \
        (lambda xb, yb: F.cross_entropy(net(xb), yb))
    counter = torch.zeros(1, dtype=torch.long, device="cuda")
    losses = torch.empty(len(batches), device="cuda")

    def step():
        index = batches.index_select(0, counter).view(-1)
        loss = loss_of(X[index], y[index])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.index_copy_(0, counter, loss.detach().view(1))
        counter.add_(1)

    saved = [p.detach().clone() for p in net.parameters()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as PyTorch's CUDA graph recipe says
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with torch.no_grad():  # the warm-up's steps undone
        for p, value in zip(net.parameters(), saved):
            p.copy_(value)

    def epoch():
        counter.zero_()
        for _ in range(len(batches)):
            graph.replay()
        return losses.cpu()

    return epoch


def with_last_batch(epoch, net_epoch_step):
    """An epoch, then one more step outside the graph for the rows that fill no whole batch (as the harness does)."""

    def both():
        losses = epoch()
        return losses if net_epoch_step is None else torch.cat([losses, net_epoch_step()])

    return both


def train_time(epoch, epochs: int) -> float:
    """Seconds of the median timed epoch, after one untimed one."""
    epoch()
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        epoch()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def training_peers(network: str, params, X: np.ndarray, y: np.ndarray, batch: int, lr: float, hidden, epochs: int):
    """Median epoch seconds of each plain loop, by the harness's peer names: X's rows in order, in batches (the rows
    that fill no whole batch are a last, smaller step, outside the graph)."""
    X_dev, y_dev = torch.from_numpy(np.ascontiguousarray(X)).cuda(), torch.from_numpy(y).cuda().long()
    full = len(X) // batch
    order = torch.arange(len(X), device="cuda")
    batches = order[: full * batch].view(full, batch)
    seconds = {}
    with fastest_pytorch():
        whole = [order[i * batch : (i + 1) * batch] for i in range(full)] + ([order[full * batch :]]
                                                                             if len(X) % batch else [])
        seconds["torch-eager"] = train_time(eager_epoch(sequential(network, params, hidden), X_dev, y_dev, whole,
                                                        lr), epochs)
        for name, compiled in (("torch-graph", False), ("torch-compile", True)):
            net = sequential(network, params, hidden)
            epoch = graph_epoch(net, X_dev, y_dev, batches, lr, compiled)
            last = eager_epoch(net, X_dev, y_dev, [order[full * batch :]], lr) if len(X) % batch else None
            seconds[name] = train_time(with_last_batch(epoch, last), epochs)
    return seconds


# ---- serving: one forward of a loaded batch per call ----


def serving_peers(params, X: np.ndarray, calls: int) -> dict[str, float]:
    """p50 microseconds of one call of each plain form of LeNet's forward on the batch X (eager, a CUDA graph
    captured once on a static input, torch.compile's reduce-overhead mode), each call waited for."""
    x = torch.from_numpy(np.ascontiguousarray(X)).cuda()
    net = sequential("lenet", params).eval()
    compiled = torch.compile(net, mode="reduce-overhead")
    with fastest_pytorch(), torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                net(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            net(x)
        forms = {"torch-eager": lambda: net(x), "torch-graph": graph.replay, "torch-compile": lambda: compiled(x)}
        return {name: p50_us(call, calls) for name, call in forms.items()}


def p50_us(call, calls: int, warmup: int = 50) -> float:
    """The median microseconds of one call and a wait for the GPU."""
    for _ in range(warmup):
        call()
        torch.cuda.synchronize()
    times = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times[i] = time.perf_counter() - start
    return float(np.median(times) * 1e6)


class fastest_pytorch:
    """PyTorch as a user tuning for speed sets it: cuDNN picks its fastest algorithms (benchmark mode),
    nondeterministic ones allowed; float32 products stay float32 (no TF32, as everywhere in this course)."""

    def __enter__(self):
        self.before = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
                       torch.backends.cudnn.enabled)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled = True, True
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.benchmark, deterministic, torch.backends.cudnn.enabled = self.before
        torch.use_deterministic_algorithms(deterministic)
