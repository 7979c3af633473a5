"""Level 9 - data parallel: two workers, each on its half of every batch.

What this level adds over level 3: a second worker. The model object lives in the caller's process and drives
WORLD worker processes, each holding one replica of the network and running level 3's NumPy step on its own share
of every batch; they join a gloo process group (torch.distributed), and after each backward pass the gradients are
summed across the workers by one all-reduce of torch.distributed's (never a communication of our own), divided by
the world size, and applied by every replica alike, so the replicas stay bit for bit the same. Parameters enter
through rank 0 only and reach the others by a broadcast, as in PyTorch's DistributedDataParallel (at construction
and at every load_state_dict: the verifier's lockstep hands level 1's parameters in before each step); they are
read back from rank 0, and train_epoch ends by checking that every replica holds the same bits.

A batch of B rows is split into WORLD contiguous shares (np.array_split: the first share takes the odd row). Each
worker's gradient is the mean over its share, weighted by share * WORLD / B (exactly 1 for equal shares), so that
the sum divided by WORLD is the mean over the whole batch also for an odd B, a partial last batch, or a share of 0
rows (a worker with no rows still joins every collective: a collective waits for every rank).

The same driver runs LeNet-5 (LeNet, below: level 3's LeNet-5 in each worker), and on GPUs either network with one GPU
per worker (device="cuda": GPUReplica, level 6's step with NCCL's all-reduce between its backward pass and its update).

The gold standard is PyTorch's own (DDP, below): the same driver and process group, each worker level 1's network
wrapped in DistributedDataParallel. It is checked against level 1 the same way, and it is the yardstick of speed.

Run: `pytest -m level9` (the GPU tests on a machine with two GPUs, after `make level9`).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import numpy as np

from common.contract import DataCache, check_params, check_training, check_X, check_y, immutable, n_steps
from common.environment import environment
from common.nets import get, lenet, mlp

WORLD = 2  # workers, one replica each
TIMEOUT = timedelta(seconds=60)  # a collective that waits longer for a rank fails, rather than hanging
BUGS = ("undivided", "same_share", "stale_buffer", "no_broadcast")  # tests/test_level9.py plants each


# ---- in each worker process: one replica ----


class Replica:
    """One worker's replica: level 3's network (net: "mlp" or "lenet"), stepped on this rank's share of every batch, its
    gradients all-reduced."""

    def __init__(self, rank: int, world: int, bug: str | None, net: str = "mlp"):
        import torch.distributed as dist

        import level3_numpy

        self.rank, self.world, self.bug, self.dist = rank, world, bug, dist
        self.network = get(net).network  # its PARAM_NAMES and param_shapes
        self.level3 = getattr(level3_numpy, get(net).class_name)
        self.model = None
        self.hidden = 0
        self.X = self.y = None
        self.buffer = np.zeros(0, dtype=np.float32)  # the gradients and the loss, flat: what is all-reduced

    def load(self, params: dict[str, np.ndarray] | None, hidden: int) -> None:
        """Rank 0's parameters (params; None on the other ranks) broadcast to every replica."""
        import torch

        shapes = self.network.param_shapes(hidden)
        self.hidden = hidden
        if params is None:  # a replica that has none yet starts from zeros, then receives rank 0's
            params = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
            if self.model is not None and self.bug == "no_broadcast":
                return
        if self.bug != "no_broadcast":
            flat = np.concatenate([np.asarray(params[name], np.float32).ravel() for name in self.network.PARAM_NAMES])
            self.dist.broadcast(torch.from_numpy(flat), src=0)
            params = self._unpack(flat, shapes)
        self._set(params)

    def _set(self, params: dict[str, np.ndarray]) -> None:
        """This replica's network, holding params."""
        self.model = self.level3(params)

    def _own_loss_and_grads(self, X: np.ndarray, y: np.ndarray):
        """The mean loss and gradients of this rank's share alone."""
        return self.model._loss_and_grads(X, y)

    def describe(self) -> dict[str, str]:
        """What this replica computes on, read from where it runs."""
        return {"device": "cpu"}

    def data(self, X: np.ndarray, y: np.ndarray) -> None:
        """The training set, kept for the epochs that follow."""
        self.X, self.y = X, y

    def epoch(self, order: np.ndarray, batch_size: int, lr: np.float32) -> np.ndarray:
        """One pass in `order`, a data-parallel step per batch; each step's loss over the whole batch."""
        from level3_numpy.mlp import sgd_update

        losses = np.empty(n_steps(len(order), batch_size), dtype=np.float32)
        for step in range(len(losses)):
            rows = order[step * batch_size : (step + 1) * batch_size]
            losses[step], grads = self.loss_and_grads(self.X, self.y, rows)
            sgd_update(self.model.params, grads, lr)
        return losses

    def time_epochs(self, order: np.ndarray, batch_size: int, lr: np.float32, rounds: int) -> list[float]:
        """Each of `rounds` epochs' seconds per step, every rank starting together (the epoch ends synchronized: its
        losses are back on the host)."""
        seconds = []
        for _ in range(rounds):
            self.dist.barrier()
            start = time.perf_counter()
            self.epoch(order, batch_size, lr)
            seconds.append((time.perf_counter() - start) / n_steps(len(order), batch_size))
        return seconds

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray, rows: np.ndarray | None = None):
        """The mean loss and gradients of the batch X[rows] (all of X: rows None), from every rank's share."""
        import torch

        rows = np.arange(len(X)) if rows is None else rows
        mine = self._share(rows)
        shapes = self.network.param_shapes(self.hidden)
        if len(mine):
            loss, grads = self._own_loss_and_grads(X[mine], y[mine])
        else:  # no rows here: nothing to add, but the collective still needs this rank
            loss, grads = np.float32(0), {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        weight = np.float32(len(mine) * self.world / len(rows))  # 1 for equal shares
        size = sum(int(np.prod(shape)) for shape in shapes.values()) + 1
        if len(self.buffer) != size:
            self.buffer = np.zeros(size, dtype=np.float32)
        if self.bug == "stale_buffer":  # reduced before this step's gradients are in it: last step's are
            self.dist.all_reduce(torch.from_numpy(self.buffer))
            self._pack(grads, loss, weight)
        else:
            self._pack(grads, loss, weight)
            self.dist.all_reduce(torch.from_numpy(self.buffer))  # the sum over the ranks, in place
        if self.bug != "undivided":
            self.buffer /= np.float32(self.world)  # the mean over the batch: the sum of the weighted means / WORLD
        return self.buffer[-1], self._unpack(self.buffer[:-1].copy(), shapes)

    def layers(self, X: np.ndarray, y: np.ndarray, rows: np.ndarray):
        """Level 3's layers of this rank's share of X[rows]: (outputs, gradients of its own mean loss), and its
        share of the rows."""
        mine = self._share(rows)
        if not len(mine):
            return None, mine
        return self.model.layers(X[mine], y[mine]), mine

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits of this rank's share of X's rows (none where X has fewer rows than there are ranks)."""
        mine = self._share(np.arange(len(X)))
        if not len(mine):
            return np.empty((0, self.network.N_OUT), np.float32)
        return self.model.forward(np.ascontiguousarray(X[mine]))

    def state(self) -> dict[str, np.ndarray]:
        return self.model.state_dict()

    def _share(self, rows: np.ndarray) -> np.ndarray:
        """This rank's share of a batch's rows: the r-th of WORLD contiguous pieces."""
        return np.array_split(rows, self.world)[0 if self.bug == "same_share" else self.rank]

    def _pack(self, grads: dict[str, np.ndarray], loss, weight: np.float32) -> None:
        """The weighted gradients, then the weighted loss, into the flat buffer."""
        start = 0
        for name in self.network.PARAM_NAMES:
            size = grads[name].size
            np.multiply(grads[name].ravel(), weight, out=self.buffer[start : start + size])
            start += size
        self.buffer[-1] = np.float32(loss) * weight

    def _unpack(self, flat: np.ndarray, shapes: dict) -> dict[str, np.ndarray]:
        """A flat buffer back into parameters (views of it) by name."""
        out, start = {}, 0
        for name in self.network.PARAM_NAMES:
            size = int(np.prod(shapes[name]))
            out[name] = flat[start : start + size].reshape(shapes[name])
            start += size
        return out


class GPUReplica(Replica):
    """One worker's replica on a GPU of its own: level 6's step (cuBLAS; for LeNet-5 cuDNN too), the gradients summed
    across the GPUs by NCCL's all-reduce, called through cffi (nccl.py). Level 9's libraries (mlp.cu, lenet.cu, gpu.py)
    queue the sum on the model's stream between each step's backward pass and its update, so a whole epoch still runs
    in level 6's native calls.
    Each rank pre-multiplies its gradients by its share of the batch, m_r / B (NCCL's PreMulSum): the sum is then the
    mean over the whole batch. A rank whose share of a batch is empty (a batch, or a partial last batch, of fewer rows
    than WORLD) still joins the step, for the all-reduce waits for every rank: it steps on a stand-in, the batch's first
    row, weighted 0, and so adds nothing to the sum. loss_and_grads (the verifier's, outside training) is level 3's
    replica's: each rank's share on its GPU, the sum on the host over gloo."""

    def __init__(self, rank: int, world: int, bug: str | None, net: str = "mlp"):
        import torch

        from level9_data_parallel import nccl

        super().__init__(rank, world, bug, net)
        ident = torch.frombuffer(bytearray(nccl.unique_id() if rank == 0 else bytes(nccl.UNIQUE_ID_BYTES)),
                                 dtype=torch.uint8)
        self.dist.broadcast(ident, src=0)  # rank 0's id reaches the others over the gloo group
        self.nccl = nccl
        self.comm = nccl.Communicator(bytes(ident.numpy()), world, rank)
        self.scale = np.float32(1)  # this rank's share of the step's batch: set before each native call
        self.unread = None  # the stale_buffer bug's target, a device buffer nothing reads

    def data(self, X: np.ndarray, y: np.ndarray) -> None:
        """The training set, made immutable, so that level 6 uploads it to this GPU once for many epochs."""
        self.X, self.y = immutable(X), immutable(y)

    def _set(self, params: dict[str, np.ndarray]) -> None:
        from level9_data_parallel import gpu

        if self.model is not None and (self.network is lenet or self.model.hidden == len(params["fc1.bias"])):
            self.model.load_state_dict(params)  # the same shapes: the same model, new parameters
            return
        self.model = gpu.SummedLeNet(params) if self.network is lenet else gpu.SummedMLP(params)
        self.model.sum_gradients_with(self._sum)

    def _sum(self, gradients: list[int], counts: list[int], rows: int, stream: int) -> None:
        """The step's sum (gradient_sum.h): queue the weighted sum of every rank's gradients, in place, on the
        model's stream."""
        targets = gradients
        if self.bug == "stale_buffer":  # the sum lands where the update never reads: each rank steps on its own
            if self.unread is None or self.unread.floats < sum(counts):
                self.unread = self.nccl.DeviceBuffer(sum(counts))
            targets = [self.unread.address + 4 * start for start in np.cumsum([0] + counts[:-1])]
        self.comm.all_reduce(list(zip(gradients, targets, counts)), float(self.scale), stream)

    def _own_loss_and_grads(self, X: np.ndarray, y: np.ndarray):
        return self.model.loss_and_grads(np.ascontiguousarray(X), np.ascontiguousarray(y))

    def _mine(self, rows: np.ndarray) -> tuple[np.ndarray, np.float32]:
        """This rank's rows of a batch, and its factor in the sum: its share of the batch (times WORLD when the planted
        bug forgets to divide); with no rows of its own, the batch's first row as a stand-in, weighted 0."""
        mine = self._share(rows)
        if not len(mine):
            return rows[:1], np.float32(0)
        return mine, np.float32(len(mine) * (self.world if self.bug == "undivided" else 1) / len(rows))

    def epoch(self, order: np.ndarray, batch_size: int, lr: np.float32) -> np.ndarray:
        """One pass in `order`: the whole batches in one native call on this rank's shares, the partial last batch (if
        any) in a second; each step's loss over the whole batch."""
        steps = n_steps(len(order), batch_size)
        whole = len(order) // batch_size
        parts = [(order[: whole * batch_size].reshape(whole, batch_size), batch_size)] if whole else []
        if whole < steps:
            parts.append((order[whole * batch_size :][None, :], len(order) - whole * batch_size))
        losses, scales = [], []
        for batches, batch in parts:  # within a part, every batch's share has the same size
            mine = [self._mine(rows) for rows in batches]
            self.scale = mine[0][1]
            rows = np.concatenate([rows for rows, _ in mine])
            losses.append(self.model.train_epoch(self.X, self.y, len(mine[0][0]), lr, rows))
            scales.append(np.full(len(batches), self.scale, np.float32))
        return self._batch_loss(np.concatenate(losses) * np.concatenate(scales))

    def describe(self) -> dict[str, str]:
        """The GPU and NCCL, and what the library computes with (the MLP's matrix product, LeNet-5's convolution)."""
        import torch

        return {**self.model.variant(), "gpu": torch.cuda.get_device_name(0), "nccl": self.nccl.version()}

    def _batch_loss(self, weighted: np.ndarray) -> np.ndarray:
        """Each step's loss over its whole batch: the ranks' weighted share losses, summed (gloo, on the host)."""
        import torch

        total = torch.from_numpy(np.ascontiguousarray(weighted, dtype=np.float32))
        self.dist.all_reduce(total)
        return total.numpy()


class DDPReplica:
    """One worker's replica of the gold standard: level 1's network wrapped in PyTorch's DistributedDataParallel,
    which broadcasts rank 0's parameters when it is made and all-reduces (and averages) the gradients during
    backward(); torch.optim.SGD then steps every replica alike. Each rank's loss is its share's summed loss times
    WORLD / B, so that DDP's average over the ranks is the mean over the whole batch, as level 1's step takes it."""

    def __init__(self, rank: int, world: int, bug: str | None, net: str = "mlp"):
        import torch.distributed as dist

        if bug is not None:
            raise ValueError("the gold standard takes no planted bug")
        self.rank, self.world, self.dist, self.net = rank, world, dist, net
        self.ddp = self.optimizer = None
        self.X = self.y = None

    def load(self, params: dict[str, np.ndarray] | None, hidden: int) -> None:
        """Rank 0's parameters (None on the others: zeros), reaching every replica by DDP's broadcast."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        network = get(self.net).network
        module = importlib.import_module(f"level1_pytorch.{self.net}")
        net = module.Net(hidden) if self.net == "mlp" else module.Net()
        shapes = network.param_shapes(hidden)
        with torch.no_grad():
            for name, tensor in net.state_dict().items():
                tensor.copy_(torch.from_numpy(params[name]) if params is not None else torch.zeros(shapes[name]))
        self.ddp = DistributedDataParallel(net)  # its construction broadcasts rank 0's parameters to every rank
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.0)

    def data(self, X: np.ndarray, y: np.ndarray) -> None:
        import torch

        self.X, self.y = torch.from_numpy(X), torch.from_numpy(y).long()

    def epoch(self, order: np.ndarray, batch_size: int, lr: np.float32) -> np.ndarray:
        """One pass in `order`, a DDP step per batch; each step's loss over the whole batch."""
        import torch

        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        losses = torch.empty(n_steps(len(order), batch_size))  # this rank's shares, summed over the ranks at the end
        for step in range(len(losses)):
            rows = order[step * batch_size : (step + 1) * batch_size]
            self.optimizer.zero_grad()
            loss = self._share_loss(self.X, self.y, rows)
            loss.backward()  # DDP all-reduces the gradients here, and divides them by WORLD
            self.optimizer.step()
            losses[step] = loss.detach()
        return self._batch_loss(losses)

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray, rows: np.ndarray | None = None):
        """The mean loss and gradients of the batch X[rows] (all of X: rows None); parameters unchanged."""
        import torch

        rows = np.arange(len(X)) if rows is None else rows
        self.optimizer.zero_grad()
        loss = self._share_loss(torch.from_numpy(X), torch.from_numpy(y).long(), rows)
        loss.backward()
        grads = {name: p.grad.detach().numpy().copy() for name, p in self.ddp.module.named_parameters()}
        self.optimizer.zero_grad()
        return self._batch_loss(loss)[()], grads

    def layers(self, X: np.ndarray, y: np.ndarray, rows: np.ndarray):
        """Level 1's layers of this rank's share of X[rows] (as Replica.layers), and its share of the rows."""
        import level1_pytorch

        mine = np.array_split(rows, self.world)[self.rank]
        if not len(mine):
            return None, mine
        return getattr(level1_pytorch, get(self.net).class_name)(self.state()).layers(X[mine], y[mine]), mine

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits of this rank's share of X's rows."""
        import torch

        mine = np.array_split(np.arange(len(X)), self.world)[self.rank]
        with torch.no_grad():
            return self.ddp.module(torch.from_numpy(np.ascontiguousarray(X[mine]))).numpy()

    def state(self) -> dict[str, np.ndarray]:
        return {name: t.detach().numpy().copy() for name, t in self.ddp.module.state_dict().items()}

    def _share_loss(self, X, y, rows: np.ndarray):
        """This rank's share of the batch's summed loss, times WORLD / B: DDP's mean over the ranks of these is the
        batch's mean loss (a rank with no rows adds 0, and still joins the all-reduce)."""
        import torch
        import torch.nn.functional as F

        mine = torch.from_numpy(np.array_split(rows, self.world)[self.rank]).long()
        summed = F.cross_entropy(self.ddp(X[mine]), y[mine], reduction="sum")
        return summed * (self.world / len(rows))

    def _batch_loss(self, loss) -> np.ndarray:
        """The batches' mean losses: the ranks' losses (a tensor of one or of each step) summed, over WORLD; one
        all-reduce, after the steps."""
        total = loss.detach().clone()
        self.dist.all_reduce(total)
        return (total / self.world).numpy().astype(np.float32)


REPLICAS = {"level3": Replica, "level6": GPUReplica, "ddp": DDPReplica}  # the worker's replica, by the driver's kind


def _serve(rank: int, world: int, store: str, conn, bug: str | None, kind: str, net: str) -> None:
    """A worker's life: join the process group, then run the driver's commands until it says close or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it ends the workers
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=TIMEOUT)
    replica = REPLICAS[kind](rank, world, bug, net)
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:  # the driver is gone
                return
            if command == "close":
                return
            try:
                conn.send(("ok", getattr(replica, command)(*args)))
            except Exception:  # reported to the driver, which raises it and ends every worker
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ---- in the caller's process: the driver ----


class WorkerError(RuntimeError):
    """A worker failed or died: the process group is broken, every worker has been ended."""


class _Workers:
    """WORLD worker processes and their pipes; ended when closed, on an error, or when the model is collected."""

    def __init__(self, world: int, bug: str | None, kind: str = "level3", gpus: list[str] | None = None,
                 net: str = "mlp"):
        """gpus: each rank's GPU (CUDA_VISIBLE_DEVICES's entry), or None on the CPU; net: the network's name."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        self.folder = tempfile.TemporaryDirectory(prefix="level9-")
        store = os.path.join(self.folder.name, "store")  # the rendezvous: a file, no port to collide
        self.conns, self.procs = [], []
        with _one_thread():
            for rank in range(world):
                ours, theirs = context.Pipe()
                proc = context.Process(target=_serve, args=(rank, world, store, theirs, bug, kind, net), daemon=True,
                                       name=f"level9-rank{rank}")
                with environment({"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus else {}):  # rank r sees GPU r only
                    proc.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)

    def ask(self, commands: list[tuple[str, tuple]]) -> list:
        """Send each rank its command, then wait for every reply; a failure or a death ends all workers and raises."""
        if not self.procs:
            raise WorkerError("the workers have stopped (an earlier failure, or close()): make a new model")
        try:
            for rank, (conn, command) in enumerate(zip(self.conns, commands)):
                try:
                    conn.send(command)
                except OSError as error:
                    raise WorkerError(f"worker {rank} is gone (exit code {self.procs[rank].exitcode})") from error
            replies: dict[int, object] = {}
            while len(replies) < len(self.conns):
                waiting = {conn: r for r, conn in enumerate(self.conns) if r not in replies}
                ready = wait(list(waiting) + [p.sentinel for p in self.procs])
                for ready_one in ready:
                    if ready_one not in waiting:
                        rank = next(r for r, p in enumerate(self.procs) if p.sentinel == ready_one)
                        raise WorkerError(f"worker {rank} died (exit code {self.procs[rank].exitcode})")
                    status, value = ready_one.recv()
                    if status == "error":
                        raise WorkerError(f"worker {waiting[ready_one]} failed:\n{value}")
                    replies[waiting[ready_one]] = value
            return [replies[r] for r in range(len(self.conns))]
        except BaseException:  # an error, or Ctrl-C while waiting: the group is in an unknown state
            self.close(wait_s=0)
            raise

    def close(self, wait_s: float = 5) -> None:
        """Tell every worker to stop, wait a little, then kill those still running."""
        for conn in self.conns:
            try:
                conn.send(("close", ()))
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        self.folder.cleanup()


def _one_thread():
    """BLAS on one thread in the workers started inside the block (they inherit the environment): WORLD workers share
    the cores."""
    return environment({name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})


class MLP:
    """The level contract, data parallel over WORLD workers, each a replica on its share of every batch. On the CPU
    (device "cpu"): level 3's step, the gradients all-reduced through torch.distributed (gloo). On GPUs ("cuda"): one
    GPU per worker, level 6's step, the gradients all-reduced by NCCL (GPUReplica). bug: one of BUGS, planted in every
    worker, for tests/test_level9.py only."""

    network = mlp
    REPLICAS = {"cpu": "level3", "cuda": "level6"}  # what each worker holds, by device: REPLICAS' key

    def __init__(self, params: dict[str, np.ndarray], workers: int = WORLD, bug: str | None = None,
                 device: str = "cpu"):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be None or one of {BUGS}, got {bug!r}")
        if device not in self.REPLICAS:
            raise ValueError(f"device must be one of {tuple(self.REPLICAS)}, got {device!r}")
        params = check_params(params, network=self.network)
        self.world, self.device = workers, device
        net = self.network.__name__.rsplit(".", 1)[-1]  # "mlp" or "lenet": the network's name in common.nets
        self._workers = _Workers(workers, bug, self.REPLICAS[device], _gpus(workers) if device == "cuda" else None, net)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._data = DataCache()
        self.load_state_dict(params)

    def close(self) -> None:
        """End the workers now (they are also ended when the model is collected, and at exit)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _all(self, command: str, *args) -> list:
        """The same command to every rank; every rank's reply."""
        return self._workers.ask([(command, args)] * self.world)

    def train_epoch(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order=None) -> np.ndarray:
        """One pass over X in `order`; returns each step's loss (of the whole batch), taken before that step's update.
        Ends by checking the replicas bit for bit."""
        rows = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(rows, batch_size, lr, order)
        losses = self._all("epoch", order, batch_size, lr)
        self.check_replicas()
        return losses[0]

    def time_epochs(self, X: np.ndarray, y: np.ndarray, batch_size: int, lr: float, order, rounds: int) -> list[float]:
        """Seconds per step of `rounds` epochs in `order`, timed inside the workers (rank 0's clock, every rank
        starting each round together): the step itself, without the driver's pipes or the replicas' check."""
        rows = self._data.fetch(X, y, self._upload)
        order, batch_size, lr = check_training(rows, batch_size, lr, order)
        return self._all("time_epochs", order, batch_size, lr, rounds)[0]

    def _upload(self, X: np.ndarray, y: np.ndarray) -> int:
        """The training set to every worker: one copy each for many epochs."""
        self._all("data", X, y)
        return len(X)

    def check_replicas(self) -> None:
        """Raise unless every replica holds the same bits as rank 0's."""
        states = self.replica_states()
        for rank, state in enumerate(states[1:], 1):
            for name in self.network.PARAM_NAMES:
                if state[name].tobytes() != states[0][name].tobytes():
                    differ = int((state[name] != states[0][name]).sum())
                    raise WorkerError(f"the replicas parted: rank {rank}'s {name} differs from rank 0's in {differ} "
                                      f"of {state[name].size} elements")

    def replica_states(self) -> list[dict[str, np.ndarray]]:
        """Every rank's parameters, rank 0's first."""
        return self._all("state")

    def variant(self) -> dict[str, str]:
        """What this model computes with, as each worker reports it: the device (and on GPUs, each GPU's name, NCCL's
        version and the matrix product), and how many workers."""
        described = self._all("describe")
        ran = {key: ", ".join(dict.fromkeys(d[key] for d in described)) for key in described[0]}
        return ran | {"workers": str(self.world)}

    def loss_and_grads(self, X: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean cross-entropy of one batch and its gradients, each rank on its share; parameters unchanged."""
        X = check_X(X)
        y = check_y(y, len(X))
        loss, grads = self._all("loss_and_grads", X, y)[0]
        return float(loss), grads

    def layers(self, X: np.ndarray, y: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every layer's output for a batch, and the gradient of the batch's mean loss with respect to each: each rank's
        share, its gradients (of its share's mean) weighted by its share of the batch."""
        X = check_X(X)
        y = check_y(y, len(X))
        outputs: dict[str, list] = {}
        grads: dict[str, list] = {}
        for layers, mine in self._all("layers", X, y, np.arange(len(X))):
            if layers is None:
                continue
            weight = np.float32(len(mine) / len(X))
            for name in layers[0]:
                outputs.setdefault(name, []).append(layers[0][name])
                grads.setdefault(name, []).append(layers[1][name] * weight)
        return ({k: np.concatenate(v) for k, v in outputs.items()}, {k: np.concatenate(v) for k, v in grads.items()})

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Logits (N, 10), each rank on its share of the rows."""
        return np.concatenate(self._all("forward", check_X(X)))

    def state_dict(self) -> dict[str, np.ndarray]:
        """float32 copies of the parameters, rank 0's."""
        return self.replica_states()[0]

    def load_state_dict(self, params: dict[str, np.ndarray]) -> None:
        """Replace the parameters (same sizes): handed to rank 0, broadcast to the others."""
        hidden = getattr(self, "hidden", None)
        params = check_params(params, hidden, network=self.network)
        self.hidden = len(params["fc1.bias"])
        self._workers.ask([("load", (params, self.hidden))] + [("load", (None, self.hidden))] * (self.world - 1))


def _gpus(world: int) -> list[str]:
    """Each rank's GPU, as CUDA_VISIBLE_DEVICES names it (the caller's own list, if it set one); an error if the
    machine has fewer than `world`."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else []
    count = torch.cuda.device_count()
    if count < world:
        raise RuntimeError(f"level 9 on GPUs runs one worker per GPU: {world} workers asked for, and this machine has "
                           f"{count} GPU{'s' * (count != 1)}")
    return gpus[:world] if visible is not None else [str(g) for g in range(world)]


class LeNet(MLP):
    """LeNet-5, data parallel the same way: on the CPU level 3's LeNet-5 in each worker, the gradients all-reduced
    through gloo; on GPUs level 6's, the gradients all-reduced by NCCL."""

    network = lenet


class DDP(MLP):
    """The gold standard of data parallelism, driven the same way: PyTorch's DistributedDataParallel over the same gloo
    process group, each worker level 1's network on its share of every batch (DDPReplica). Verified against level 1's
    single-process step like level 9, and the yardstick of its speed. The network, the MLP or LeNet-5, is the one the
    parameters' names say."""

    REPLICAS = {"cpu": "ddp"}

    def __init__(self, params: dict[str, np.ndarray], workers: int = WORLD):
        self.network = lenet if isinstance(params, dict) and set(params) == set(lenet.PARAM_NAMES) else mlp
        super().__init__(params, workers)

    def variant(self) -> dict[str, str]:
        return {"device": "cpu", "workers": str(self.world), "written as": "PyTorch's DistributedDataParallel, gloo"}
