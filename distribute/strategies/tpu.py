"""`TPUStrategy`: synchronous training on XLA devices through torch_xla.

Two modes, one API:

* **replica mode** (default): one replica per XLA device (per the device
  assignment's first logical core), in threads, like `MirroredStrategy`; variables
  are `MirroredVariable`s with a copy per device, and gradients are summed at the
  optimizer step (on the host where the runtime has no working per-device
  collectives, as on torch_xla's CPU backend: NOTE [host reduction]).
* **SPMD mode** (``experimental_spmd_xla_partitioning=True``): one program over
  every device through `torch_xla.distributed.spmd`. `fn` runs ONCE, over the
  global batch, whose dim 0 is sharded along the mesh's ``"data"`` axis; variables
  are replicated (or split by `experimental_split_to_logical_devices`, or laid out
  by a ``layout_map``), and GSPMD inserts the collectives. Values `fn` returns are
  global: `reduce` returns them (they already combine every replica), `gather`
  returns them, and `experimental_local_results(v)` is ``(v,)``. Inside `fn` the
  losses helpers count one program (`compute_average_loss` divides by the global batch).

Each `run` ends an XLA step on the devices it used (NOTE [XLA steps]), so a loop
compiles one graph per input shape. Keep shapes static: batch with
``drop_last=True``, or accept one more compile for the last, partial batch (a step
that keeps compiling after its first runs, or after ``fit``'s first epoch, is warned
of once: NOTE [recompilation] in _xla_compiles.py). In SPMD
mode, inside `TPUStrategy.one_execution()` the calls share one step instead:
several training steps recorded into one graph and executed once (Keras's
``steps_per_execution``).

Example::

    strategy = ds.TPUStrategy(experimental_spmd_xla_partitioning=True)
    with strategy.scope():
        model = torch.nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in strategy.experimental_distribute_dataset(loader):
        loss = strategy.run(step, args=(batch,))
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from distribute import context, values
from distribute._enums import StepRunner
from distribute.cluster_resolver.tpu import TPUClusterResolver
from distribute.collectives import xla
from distribute.data._xla_input import XlaShardedDataset, global_batches
from distribute.data.options import InputOptions
from distribute.errors import InvalidArgumentError
from distribute.strategies._layout import LayoutMap, resolve_layouts
from distribute.strategies._module_recorder import ModuleRecorder
from distribute.strategies._replicated import ReplicatedExtended
from distribute.strategies._xla_compiles import CompileWatch, step_signature
from distribute.strategies.base import Strategy
from distribute.tpu import DeviceAssignment, initialize_tpu_system
from distribute.variables import DistributedVariable, capture_buffer, capture_parameter

__all__ = ["TPUStrategy"]

#: The device every tensor lives on under SPMD (torch_xla's one virtual device).
_SPMD_DEVICE = "xla:0"


class _SpmdLayout:
    """The SPMD mesh of a device assignment, and how tensors are annotated on it.

    The mesh is ``(num_replicas, cores_per_replica)`` with axes ``("data",
    "model")``, row r holding replica r's logical cores.
    """

    @staticmethod
    def check(assignment: DeviceAssignment, num_devices: int) -> None:
        """Refuses an assignment that leaves devices out (one program spans all)."""
        replicas, cores = assignment.num_replicas, assignment.num_cores_per_replica
        if replicas * cores != num_devices:
            raise InvalidArgumentError(
                f"SPMD mode runs one program over every device, but the device assignment "
                f"covers {replicas} replica(s) x {cores} core(s) = {replicas * cores} of the "
                f"{num_devices} devices; build it with num_replicas={num_devices // cores}, "
                "or use replica mode (experimental_spmd_xla_partitioning=False)"
            )

    def __init__(self, assignment: DeviceAssignment, num_devices: int) -> None:
        self.check(assignment, num_devices)
        replicas, cores = assignment.num_replicas, assignment.num_cores_per_replica
        self._xs = xla.spmd()
        self._ids = np.array(
            [[assignment.tpu_ordinal(r, c) for c in range(cores)] for r in range(replicas)]
        )
        self.replicas = replicas
        self.cores = cores
        self.mesh = self._xs.Mesh(self._ids.reshape(-1), (replicas, cores), ("data", "model"))
        # One core per replica: batches go in one sharded transfer, on a 1-D mesh (a
        # transfer's spec must name every axis of its mesh).
        self._data_mesh = (
            self._xs.Mesh(self._ids.reshape(-1), (replicas,), ("data",)) if cores == 1 else None
        )
        self._split_meshes: dict[tuple[int, ...], Any] = {}
        self._transfers: dict[tuple[str | None, ...], Any] = {}
        self._lock = threading.Lock()

    def data_spec(self, tensor: torch.Tensor) -> tuple[str | None, ...]:
        return ("data",) + (None,) * (tensor.dim() - 1)

    def place_batch(self, batch: Any) -> Any:
        """Every tensor to the device, dim 0 split on ``"data"`` (scalars replicated):
        one sharded transfer per tensor with one core per replica; with several, a
        transfer then the annotation (a transfer's spec cannot leave the cores' axis
        replicated)."""
        import torch_xla.core.xla_model as xm

        def place(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            spec = self.data_spec(leaf) if leaf.dim() else ()
            if self.cores == 1:
                (placed,) = xm.send_cpu_data_to_device([leaf], _SPMD_DEVICE, self._transfer(spec))
                return placed
            placed = leaf.to(_SPMD_DEVICE)
            self._xs.mark_sharding(placed, self.mesh, spec)
            return placed

        return values.map_structure(place, batch)

    def _transfer(self, spec: tuple[str | None, ...]) -> Any:
        """The `ShardingSpec` of a transfer on the data mesh, made once per spec (making
        one costs about 0.1 ms: a tenth of a small step's time per batch)."""
        with self._lock:
            sharding = self._transfers.get(spec)
            if sharding is None:
                sharding = self._transfers[spec] = self._xs.ShardingSpec(self._data_mesh, spec)
        return sharding

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        self._xs.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())
        return tensor

    def split(self, tensor: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
        """Splits `tensor` `dims[k]` ways along dim k inside each replica (replicated
        across replicas)."""
        key = tuple(dims)
        with self._lock:
            mesh = self._split_meshes.get(key)
            if mesh is None:
                names = ("data", *(f"split{k}" for k in range(len(key))))
                mesh = self._xs.Mesh(self._ids.reshape(-1), (self.replicas, *key), names)
                self._split_meshes[key] = mesh
        spec = tuple(f"split{k}" if d > 1 else None for k, d in enumerate(key))
        self._xs.mark_sharding(tensor, mesh, spec)
        return tensor


class _GspmdLayout:
    """SPMD mode with a ``layout_map``: the replicated engine's `ModuleCapture` and
    `ScopeLifecycle` (`_engine_parts.py`). Parameters become the engine's variables as
    usual; it remembers which module holds which submodule (a variable's path is known
    once its model is built) and hands the variables the engine placed to
    `TPUStrategy._lay_out` when the outermost scope is left, or at `run`."""

    def __init__(self, strategy: TPUStrategy) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self._recorder = ModuleRecorder("TPUStrategy")  # parent links: a variable's path

    @property
    def _strategy(self) -> TPUStrategy:
        strategy = self._strategy_ref()
        assert strategy is not None, "the strategy is gone"
        return strategy

    # -- capture ------------------------------------------------------------------------

    def captures(self, module: torch.nn.Module, tensor: torch.Tensor) -> bool:
        return True

    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        return capture_parameter(self._strategy, module, name, param)

    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        return capture_buffer(self._strategy, module, name, buffer)

    def capture_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        self._recorder.record_child(parent, child)

    # -- lifecycle ----------------------------------------------------------------------

    def placed(self, variables: list[DistributedVariable]) -> None:
        if variables:
            self._strategy._lay_out(variables, self._recorder.root_of)

    def scope_entered(self) -> None:
        """Nothing: variables are laid out once placed (`placed`)."""

    def scope_leaving(self) -> None:
        """Nothing: the engine places the variables first."""

    def scope_left(self) -> None:
        """Nothing more than `placed`."""

    def before_run(self) -> None:
        """Nothing: the engine places the variables first."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class TPUStrategy(Strategy):
    """Synchronous data parallelism on XLA devices (TPUs, or torch_xla's CPU backend).

    `ds.Model.fit` and `evaluate` on arrays pad the last, partial batch to the full
    batch size with weight-0 rows, so it reuses the compiled step.

    Args:
        tpu_cluster_resolver: a `TPUClusterResolver` (None: this host's devices).
        experimental_device_assignment: which devices each replica's logical cores
            use (`ds.tpu.DeviceAssignment.build`); None: one replica per device.
        experimental_spmd_xla_partitioning: run one SPMD program over every device
            (see the module docstring) instead of one replica per device.
        layout_map: SPMD mode only: a ``ds.experimental.LayoutMap`` (the one
            `ModelParallelStrategy` takes) over a ``DeviceMesh`` of shape
            ``(num_replicas, cores_per_replica)`` with axes ``("data", "model")``.
            The parameters and buffers of modules built in the scope whose path
            (``named_parameters()`` style, from the outermost module built there) has
            a layout are sharded for GSPMD as it says (each named axis splits its
            dimension; None: whole); every other variable, and a ``ds.Variable``
            (which has no path), is replicated. The numbers stay the default
            strategy's.

    Raises:
        InvalidArgumentError: torch_xla is not installed; replica mode in a process
            already in SPMD mode; an SPMD assignment that does not cover every device;
            a ``layout_map`` in replica mode, or over a mesh whose axis names or shape
            are not the device assignment's; a layout whose length is not its
            variable's number of dimensions (raised when the scope is left).
        XlaAutogradError: the process ran its first backward before torch_xla's
            runtime started, so autograd can never run one on an XLA device in it
            (create the strategy, or call `ds.tpu.initialize_tpu_system`, first).

    Example::

        resolver = ds.cluster_resolver.TPUClusterResolver()
        strategy = ds.TPUStrategy(resolver)              # PJRT_DEVICE=CPU CPU_NUM_DEVICES=4
        strategy.num_replicas_in_sync                    # 4
        strategy.run(lambda: ds.get_replica_context().replica_id_in_sync_group)
        # PerReplica(0, 1, 2, 3)

    Model parallelism with a layout map (2 replicas x 2 cores over 4 devices)::

        topology = ds.tpu.initialize_tpu_system()
        assignment = ds.tpu.DeviceAssignment.build(topology, [1, 1, 1, 2], num_replicas=2)
        mesh = ds.experimental.DeviceMesh((2, 2), ("data", "model"))
        layout_map = ds.experimental.LayoutMap(mesh)
        layout_map[r"0\\.weight"] = ("model", None)      # torch Linear weight: (out, in)
        layout_map[r"2\\.weight"] = (None, "model")
        strategy = ds.TPUStrategy(
            experimental_device_assignment=assignment,
            experimental_spmd_xla_partitioning=True,
            layout_map=layout_map,
        )
        with strategy.scope():
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
            )
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: DeviceAssignment | None = None,
        experimental_spmd_xla_partitioning: bool = False,
        layout_map: LayoutMap | None = None,
    ) -> None:
        if layout_map is not None and not experimental_spmd_xla_partitioning:
            raise InvalidArgumentError(
                "layout_map lays variables out for GSPMD, which needs SPMD mode; pass "
                "experimental_spmd_xla_partitioning=True (replica mode keeps a whole copy "
                "of every variable per replica)"
            )
        xla.require_torch_xla()
        xr = xla.runtime()
        if not experimental_spmd_xla_partitioning and xr.is_spmd():
            raise InvalidArgumentError(
                "this process already runs torch_xla in SPMD mode (an SPMD TPUStrategy was "
                "built), and replica mode cannot share it; pass "
                "experimental_spmd_xla_partitioning=True, or use another process"
            )
        self._resolver = tpu_cluster_resolver or TPUClusterResolver()
        topology = initialize_tpu_system(self._resolver)
        num_devices = topology.num_tpus_per_task
        assignment = experimental_device_assignment or DeviceAssignment.build(
            topology, num_replicas=num_devices
        )
        self._assignment = assignment
        self._spmd = bool(experimental_spmd_xla_partitioning)
        self._layout: _SpmdLayout | None = None
        self._executions = threading.local()  # `open`: one_execution()s open in a thread
        # Warns of steps that keep compiling (NOTE [recompilation]).
        self._compiles = CompileWatch(xla.compile_count)
        self._layout_map = layout_map
        if self._spmd:
            _SpmdLayout.check(assignment, num_devices)  # before SPMD mode, which is for good
            if layout_map is not None:
                self._check_layout_map(layout_map, assignment)
            if not xr.is_spmd():
                xr.use_spmd()  # before any XLA tensor of this process exists
            self._layout = _SpmdLayout(assignment, num_devices)
            self._step_devices = [torch.device(_SPMD_DEVICE)]
            layout = _GspmdLayout(self) if layout_map is not None else None
            # ds.Model pads partial batches to the full size (weight 0): XLA compiles
            # per shape.
            extended = ReplicatedExtended(
                self,
                [_SPMD_DEVICE],
                wrap_single_values=False,
                static_batch_shapes=True,
                capture=layout,
                lifecycle=layout,
                step_runner=StepRunner.XLA_EXECUTIONS,
            )
        else:
            devices = [
                f"xla:{assignment.tpu_ordinal(r, 0)}" for r in range(assignment.num_replicas)
            ]
            self._step_devices = sorted(
                {
                    torch.device(f"xla:{assignment.tpu_ordinal(r, c)}")
                    for r in range(assignment.num_replicas)
                    for c in range(assignment.num_cores_per_replica)
                },
                key=lambda d: d.index or 0,
            )
            extended = ReplicatedExtended(
                self, devices, static_batch_shapes=True, step_runner=StepRunner.XLA_EXECUTIONS
            )
        # Autograd's device queues were sized at the process's first backward: refuse
        # here, with the fix, what would fail inside autograd at the first step.
        xla.check_autograd(self._step_devices)
        super().__init__(extended)
        self._engine = extended

    # -- identity -------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas of the device assignment (the mesh's data axis under SPMD)."""
        return self._assignment.num_replicas

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        """The `TPUClusterResolver` this strategy runs on."""
        return self._resolver

    @property
    def spmd(self) -> bool:
        """Whether this strategy runs one SPMD program over every device."""
        return self._spmd

    # -- layout map (SPMD) ------------------------------------------------------------

    @staticmethod
    def _check_layout_map(layout_map: Any, assignment: DeviceAssignment) -> None:
        """Refuses a map whose mesh is not the SPMD mesh of ``assignment``."""
        if not isinstance(layout_map, LayoutMap):
            raise InvalidArgumentError(
                f"layout_map must be a ds.experimental.LayoutMap, got {type(layout_map).__name__}"
            )
        mesh = layout_map.device_mesh
        want_shape = (assignment.num_replicas, assignment.num_cores_per_replica)
        want_names = ("data", "model")
        if mesh.axis_names != want_names or mesh.shape != want_shape:
            raise InvalidArgumentError(
                f"layout_map's mesh has axis_names={mesh.axis_names} and shape={mesh.shape}, "
                f"but the device assignment's SPMD mesh has axis_names={want_names} and "
                f"shape={want_shape} (num_replicas, cores_per_replica); build the LayoutMap "
                f"over ds.experimental.DeviceMesh({want_shape}, {want_names})"
            )

    def _lay_out(
        self,
        placed: Sequence[DistributedVariable],
        root_of: Callable[[torch.nn.Module], torch.nn.Module],
    ) -> None:
        """Annotates variables just placed on the device for GSPMD: each module
        variable as the layout map says for its path from its outermost module (the
        layouts checked by `resolve_layouts` first), every other one replicated."""
        assert self._layout is not None and self._layout_map is not None
        xs, mesh = self._layout._xs, self._layout.mesh
        todo = {id(v): v for v in placed}
        roots: dict[int, torch.nn.Module] = {}
        for var in placed:
            for ref, _, _ in var._ds_owners:
                module = ref()
                if module is not None:
                    root = root_of(module)
                    roots.setdefault(id(root), root)
        specs: dict[int, tuple[str | None, ...]] = {}
        for root in roots.values():
            layouts = resolve_layouts(self._layout_map, root)
            tensors: dict[str, torch.Tensor] = dict(root.named_parameters(remove_duplicate=False))
            tensors.update(root.named_buffers(remove_duplicate=False))
            for path, layout in layouts.items():
                tensor = tensors[path]
                if id(tensor) in todo and layout is not None:
                    specs.setdefault(id(tensor), layout.axes)
        for key, var in todo.items():
            spec = specs.get(key, (None,) * var.dim())
            xs.mark_sharding(var, mesh, spec)

    # -- run ------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Runs `fn` per replica (replica mode) or once over the global batch (SPMD
        mode), then ends the XLA step so the next call reuses the compiled graph.

        Example::

            loss = strategy.run(step_fn, args=(next(iterator),))
        """
        in_execution = getattr(self._executions, "open", 0)
        # The same step over a model made since (its first runs compile) is another.
        engine = self._engine
        models = (engine._variables_made, engine._layout_generation)
        signature = (step_signature(fn, args, kwargs or {}), models)
        before = self._compiles.count()
        try:
            result = super().run(fn, args, kwargs, options)
        finally:
            if not in_execution:
                xla.mark_step(self._step_devices)
        if in_execution:
            self._executions.steps.append(signature)  # compiled when the execution ends
        else:
            self._compiles.after(signature, before)
        return result

    @contextlib.contextmanager
    def one_execution(self) -> Iterator[None]:
        """SPMD mode: the `run` calls made inside it (in this thread) are recorded into
        one XLA graph, compiled once and executed once, when it exits: what TF gets
        from a loop of ``strategy.run`` inside one ``tf.function``, and Keras from
        ``steps_per_execution`` (`ds.Model.fit` uses this). NOTE [steps per execution]
        in `distribute/training/_xla_steps.py`. Do not read a value a step returned
        (``float``, ``.cpu()``) before it exits: the read would execute the graph
        recorded so far.

        Replica mode: each `run` still ends its own step. Its gradients meet on the
        host at every optimizer step (NOTE [host reduction]), which executes each
        device's graph then anyway; leaving the step open there would only chain the
        pending updates into the next step's graph (one graph per position in the
        execution, N + 1 to compile, for no measured gain).

        Example::

            with strategy.one_execution():
                losses = [strategy.run(step, args=(next(iterator),)) for _ in range(8)]
            print([float(loss) for loss in losses])    # after the 8 steps ran
        """
        if not self._spmd:
            yield
            return
        depth = getattr(self._executions, "open", 0)
        self._executions.open = depth + 1
        if depth == 0:
            self._executions.steps = []
            before = self._compiles.count()
        try:
            yield
        finally:
            self._executions.open = depth
            if depth == 0:
                xla.mark_step(self._step_devices)
        if depth == 0:
            self._compiles.after(("execution", tuple(self._executions.steps)), before)

    def one_epoch(self) -> contextlib.AbstractContextManager[None]:
        """One epoch of a training loop: the compiles of the first are the steps'
        warm-up; after it, a step that compiles again is warned of (NOTE
        [recompilation] in `strategies/_xla_compiles.py`; `ds.Model.fit` uses this).
        Outside it, a custom loop's first runs are its warm-up.

        Example::

            for epoch in range(epochs):
                with strategy.one_epoch():
                    for batch in dataset:
                        strategy.run(step, args=(batch,))
        """
        return self._compiles.epoch()

    # -- input ----------------------------------------------------------------------

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> Any:
        """Replica mode: each global batch split per replica onto its device (as in
        `MirroredStrategy`). SPMD mode: each global batch whole, on the device with
        dim 0 sharded along ``"data"``, sent in one sharded transfer per tensor.

        Example::

            for batch in strategy.experimental_distribute_dataset(loader):
                strategy.run(step, args=(batch,))
        """
        if self._layout is None:
            return super().experimental_distribute_dataset(dataset, options)
        layout = self._layout
        options = options or InputOptions()
        # The one-program dataset keeps what every strategy's does (epochs reshuffled
        # by a sampler's set_epoch, auto-sharding, end of data); its batches stay on
        # the host and are placed, sharded, by the thread that takes them.
        on_host = super().experimental_distribute_dataset(
            dataset, dataclasses.replace(options, experimental_fetch_to_device=False)
        )
        fetch = options.experimental_fetch_to_device
        return XlaShardedDataset(
            lambda: iter(on_host), layout.place_batch if fetch else (lambda b: b)
        )

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], options: InputOptions | None = None
    ) -> Any:
        """`dataset_fn(InputContext)` yields per-replica batches. Replica mode: one per
        replica each step. SPMD mode: ``num_replicas_in_sync`` consecutive ones
        concatenated into the global batch, sharded along ``"data"``.

        Example::

            def dataset_fn(ctx):
                return loader_of(ctx.get_per_replica_batch_size(64))
            iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        """
        if self._layout is None:
            return super().distribute_datasets_from_function(dataset_fn, options)
        layout = self._layout
        fetch = options is None or options.experimental_fetch_to_device
        return XlaShardedDataset(
            global_batches(dataset_fn, layout.replicas),
            layout.place_batch if fetch else (lambda b: b),
        )

    # -- logical devices ------------------------------------------------------------

    def experimental_assign_to_logical_device(
        self, tensor: torch.Tensor, logical_device_id: int
    ) -> torch.Tensor:
        """Places `tensor` on the running replica's logical core `logical_device_id`
        (replica mode); later ops on it run there.

        Raises:
            InvalidArgumentError: in SPMD mode (a mesh annotation covers every
                device; use `experimental_split_to_logical_devices`), or an id beyond
                the logical cores per replica.

        Example::

            output = strategy.experimental_assign_to_logical_device(x + x, 0)
        """
        if self._spmd:
            raise InvalidArgumentError(
                "experimental_assign_to_logical_device is not supported in SPMD mode: one "
                "program spans every device; use experimental_split_to_logical_devices or "
                "experimental_replicate_to_logical_devices"
            )
        cores = self._assignment.num_cores_per_replica
        if not 0 <= logical_device_id < cores:
            raise InvalidArgumentError(
                f"logical_device_id={logical_device_id} is out of range: each replica has "
                f"{cores} logical device(s) (ids 0 to {cores - 1}); build the device "
                "assignment with a larger computation_shape for more"
            )
        replica_ctx = context.get_replica_context()
        replica = replica_ctx.replica_id_in_sync_group if replica_ctx is not None else 0
        ordinal = self._assignment.tpu_ordinal(replica, logical_device_id)
        return tensor.to(f"xla:{ordinal}")

    def experimental_split_to_logical_devices(
        self, tensor: torch.Tensor, partition_dimensions: Sequence[int]
    ) -> torch.Tensor:
        """Splits `tensor` along each dim k into `partition_dimensions[k]` parts over
        the replica's logical devices (SPMD: a sharding annotation; replica mode,
        where a replica runs on its first core, the tensor is returned as is).

        Under SPMD the tensor is the same on every replica afterwards (dims of 1
        are whole on each core): right for weights; an activation sharded by batch
        is gathered first, so split those along the batch's dim only with care.

        Raises:
            InvalidArgumentError: `partition_dimensions` does not have one entry per
                dim, an entry does not divide its dim, or their product is not the
                number of logical devices per replica.

        Example::

            x = strategy.experimental_split_to_logical_devices(x, [1, 2])
        """
        dims = [int(d) for d in partition_dimensions]
        cores = self._assignment.num_cores_per_replica
        if len(dims) != tensor.dim():
            raise InvalidArgumentError(
                f"partition_dimensions {dims} has {len(dims)} entries but the tensor has "
                f"rank {tensor.dim()} (shape {tuple(tensor.shape)}); give one per dimension"
            )
        for k, (size, parts) in enumerate(zip(tensor.shape, dims)):
            if parts < 1 or size % parts:
                raise InvalidArgumentError(
                    f"partition_dimensions[{k}]={parts} does not divide dimension {k} of size "
                    f"{size} (shape {tuple(tensor.shape)}); pick a divisor"
                )
        if math.prod(dims) != cores:
            raise InvalidArgumentError(
                f"the product of partition_dimensions {dims} is {math.prod(dims)}, but each "
                f"replica has {cores} logical device(s); they must be equal"
            )
        tensor = self._on_device(tensor)
        if self._layout is None:
            return tensor
        return self._layout.split(tensor, dims)

    def experimental_replicate_to_logical_devices(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keeps a whole copy of `tensor` on each of the replica's logical devices
        (SPMD: a replicated annotation; replica mode: returned as is).

        Example::

            w = strategy.experimental_replicate_to_logical_devices(w)
        """
        tensor = self._on_device(tensor)
        if self._layout is None:
            return tensor
        return self._layout.replicate(tensor)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor copied where the running replica (SPMD: the program) computes,
        as `run` places its arguments; an XLA tensor as it is."""
        if tensor.device.type == "xla":
            return tensor
        if self._spmd:
            return tensor.to(_SPMD_DEVICE)
        replica_ctx = context.get_replica_context()
        local = replica_ctx.replica_id_in_sync_group if replica_ctx is not None else 0
        return tensor.to(self.extended.worker_devices[local])

    def __repr__(self) -> str:
        mode = "spmd" if self._spmd else "replica"
        return (
            f"TPUStrategy(mode={mode!r}, num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"cores_per_replica={self._assignment.num_cores_per_replica})"
        )
