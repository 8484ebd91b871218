"""The trainer's FSDP2 flags checked against the rest of a config, before any rank starts (no torch here).

* ``reshard_after_forward`` (True, False, or None for FSDP2's default) means something only to the
  strategies built on ``fully_shard``: ``fsdp2`` and ``hsdp``.
* ``replicate`` x ``shard`` is hsdp's 2-D mesh, and must hold the whole world: each given size must
  divide the world size, and a size left out (0) is what the other leaves. Neither given: one replica
  group sharded over the whole world (torchtitan's defaults: replicate degree 1, the shard degree
  takes the rest).
"""

from __future__ import annotations

SHARDED = ("fsdp2", "hsdp")  # the strategies that keep only a shard of each parameter (FSDP2's fully_shard)


def hsdp_mesh(world_size: int, replicate: int, shard: int) -> tuple[int, int]:
    """(replicate, shard), the ones not given (0) filled in from the world size."""
    if not replicate and not shard:
        return 1, world_size
    return replicate or world_size // shard, shard or world_size // replicate


def check(cfg, need) -> None:
    """Each FSDP2 flag with a strategy it means something to, and hsdp's mesh filling the world.
    ``need(condition, message)`` raises the config's one-line ``ValueError``."""
    need(cfg.reshard_after_forward in (None, True, False), "reshard-after-forward must be True, False or None")
    need(cfg.reshard_after_forward is None or cfg.strategy in SHARDED,
         f"--reshard-after-forward decides when FSDP2 frees gathered parameters: it means nothing with "
         f"strategy {cfg.strategy}: use --strategy fsdp2 or hsdp, or leave it out")
    need(not (cfg.replicate or cfg.shard) or cfg.strategy == "hsdp",
         f"--replicate and --shard lay out strategy hsdp's 2-D mesh, not {cfg.strategy}'s: use --strategy hsdp "
         f"or leave them out")
    if cfg.strategy != "hsdp":
        return
    need(cfg.tp == 1 and cfg.pp == 1, "strategy hsdp shards over its own 2-D mesh of the whole world: "
         "leave out --tp and --pp (use --strategy fsdp2 --tp N for tensor parallel x FSDP2)")
    for name in ("replicate", "shard"):
        given = getattr(cfg, name)
        need(not given or cfg.world_size % given == 0,
             f"hsdp {name} {given} does not divide the world size {cfg.world_size}: choose a divisor of {cfg.world_size}")
    replicate, shard = hsdp_mesh(cfg.world_size, cfg.replicate, cfg.shard)
    need(replicate * shard == cfg.world_size,
         f"hsdp replicate x shard = {replicate} x {shard} = {replicate * shard} does not match the world size "
         f"{cfg.world_size}: choose replicate x shard = {cfg.world_size}")
