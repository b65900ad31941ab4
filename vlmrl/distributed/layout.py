"""The process layout of a colocated run: which training rank holds which trainer shard and which rollout engine
rank. One record (`EngineLayout`), built from the run's sizes before any process starts, printed at start
(`describe`), and read by the placement, the memory plan, the tests and docs/distributed.md.

    dp = 4 training ranks, tensor parallel k = 2 (rollout.tensor_parallel_size), vLLM:

        rank    0        1        2        3
        trainer shard 0/4 shard 1/4 shard 2/4 shard 3/4      (FSDP2 over all four)
        engine  g0 tp0   g0 tp1   g1 tp0   g1 tp1            (two engines, each across two ranks)

Engine group g holds ranks [g*k, (g+1)*k): consecutive ranks, on one node when the node's rank count is a multiple
of k (verl's layout). Each group generates its share of the requests (`split_evenly` over the groups, results
request-major as at k = 1); a weight sync loads every tensor into every engine rank, and each engine slices its own
shard. How a group's k ranks become one engine depends on the engine:

- vLLM (`spmd`): every rank of the group builds the engine in its own process (`distributed_executor_backend=
  "external_launcher"`: each process one TP rank, joined through the trainer's own process group) and every rank
  calls generate with the same requests; the ranks compute the same tokens, and the group's first rank's are taken.
- SGLang: the group's first rank builds one Engine at `tp_size=k`, which starts its k TP processes itself (on a GPU
  node, on the group's k devices); the other ranks of the group host no engine object.
"""

from __future__ import annotations

from dataclasses import dataclass

SPMD_ENGINES = ("vllm",)
"""Engines whose TP ranks each live in a training worker's process (vLLM's external launcher)."""


@dataclass(frozen=True)
class EngineLayout:
    """The ranks of a colocated run and the engines across them."""

    dp: int
    """Training ranks (one device each), the trainer's FSDP2 shards."""
    tp: int = 1
    """Tensor-parallel size of each engine (rollout.tensor_parallel_size): it divides dp."""
    engine: str | None = None
    """The rollout backend the ranks host (vllm, sglang, hf), None: the ranks only train."""
    placement: str = "worker"
    """trainer.engine_placement: `worker` (the groups above) or `node` (one engine, at k = 1, on each node's first
    rank: `nodes` says which rank sits where)."""
    nodes: tuple[str, ...] = ()
    """The node of each rank (known once the workers are placed; only `node` placement reads it)."""
    rollout_workers: int = 0
    """> 0: the engines run in that many Ray actors of their own (trainer.async_rollout.rollout_workers, each engine
    at TP `tp` on a placement group of its own), not in the training ranks: the ranks then only train."""

    def __post_init__(self) -> None:
        if self.placement not in ("worker", "node"):
            raise ValueError(f"engine placement {self.placement!r}: choose worker or node")
        if self.tp < 1 or (self.dp % self.tp and not self.rollout_workers):
            raise ValueError(f"rollout.tensor_parallel_size={self.tp} must divide the {self.dp} training ranks "
                             "(n_gpus_per_node x nnodes): each engine spans that many consecutive ranks")
        if self.placement == "node" and self.tp > 1:
            raise ValueError(f"trainer.engine_placement=node runs one single-device engine per node; with "
                             f"rollout.tensor_parallel_size={self.tp} use engine_placement=worker")

    @property
    def spmd(self) -> bool:
        """Each rank of an engine group runs its own TP rank of the engine (vLLM); else the group's first rank
        builds the whole engine (SGLang, hf at k = 1)."""
        return self.tp > 1 and self.engine in SPMD_ENGINES

    @property
    def groups(self) -> list[list[int]]:
        """The ranks of each engine, in order (empty when the ranks only train).

        >>> EngineLayout(dp=4, tp=2, engine="vllm").groups
        [[0, 1], [2, 3]]
        """
        if self.engine is None or self.rollout_workers:
            return []
        if self.placement == "node":
            return [[rank] for rank, node in enumerate(self.nodes) if node not in self.nodes[:rank]]
        return [list(range(start, start + self.tp)) for start in range(0, self.dp, self.tp)]

    @property
    def leaders(self) -> list[int]:
        """The first rank of each group: where its requests go and whose results are taken."""
        return [group[0] for group in self.groups]

    @property
    def hosts(self) -> list[int]:
        """The ranks that build an engine object: every rank of a group (spmd), else each group's first.

        >>> EngineLayout(dp=4, tp=2, engine="vllm").hosts, EngineLayout(dp=4, tp=2, engine="sglang").hosts
        ([0, 1, 2, 3], [0, 2])
        """
        return [rank for group in self.groups for rank in (group if self.spmd else group[:1])]

    def group_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        """The rank's place in its engine group (its TP rank in that engine)."""
        return rank % self.tp

    def cpu_binding(self, rank: int, cores: int) -> str:
        """SGLang's CPU thread binding (`SGLANG_CPU_OMP_THREADS_BIND`) for the engine a group's first rank builds:
        one core range per TP rank, "|"-separated: the group's ranks' share of the node's `cores` split evenly over
        all dp ranks (without it SGLang refuses more TP ranks than NUMA nodes).

        >>> EngineLayout(dp=2, tp=2, engine="sglang").cpu_binding(0, cores=2)
        '0|1'
        >>> EngineLayout(dp=4, tp=2, engine="sglang").cpu_binding(2, cores=8)
        '4-5|6-7'
        """
        from vlmrl.rollout.config import even_binding

        first = rank - self.tp_rank(rank)
        return "|".join(even_binding(self.dp, cores).split("|")[first:first + self.tp])

    def describe(self) -> str:
        """What each rank holds, in a few lines (logged at start; docs/distributed.md shows the same).

        >>> print(EngineLayout(dp=2, tp=2, engine="vllm").describe())
        2 training ranks, FSDP2: each holds 1/2 of the parameters, gradients and optimizer state
        1 vllm engine at tensor parallel 2:
          engine 0 on ranks [0, 1]: TP ranks 0-1, each in a training worker's own process; requests to rank 0
        """
        lines = [f"{self.dp} training ranks, FSDP2: each holds 1/{self.dp} of the parameters, gradients and "
                 "optimizer state" if self.dp > 1 else "1 training process: the whole actor"]
        if self.rollout_workers:
            return "\n".join(lines + [f"{self.rollout_workers} {self.engine} rollout worker"
                                      f"{'s' if self.rollout_workers > 1 else ''} at tensor parallel {self.tp}, in "
                                      "Ray actors of their own, each on a placement group of "
                                      f"{self.tp} device{'s' if self.tp > 1 else ''} on any node with room; weights "
                                      "through a collective group or Ray's object store "
                                      "(trainer.async_rollout.weight_transfer)"])
        if self.engine is None:
            return lines[0] + "\nno colocated engine"
        if self.dp == 1:
            return "\n".join(lines + [f"the {self.engine} engine in the same process"])
        lines.append(f"{len(self.groups)} {self.engine} engine{'s' if len(self.groups) > 1 else ''} at tensor "
                     f"parallel {self.tp}:")
        for g, group in enumerate(self.groups):
            if self.tp == 1:
                how = "in the worker's process"
            elif self.spmd:
                how = f"TP ranks 0-{self.tp - 1}, each in a training worker's own process"
            else:
                how = f"built by rank {group[0]}, whose engine starts its {self.tp} TP processes"
            lines.append(f"  engine {g} on ranks {group}: {how}; requests to rank {group[0]}")
        return "\n".join(lines)
