"""The config checks of the mixture of experts (``--experts``, ``--top-k``, ``--capacity-factor``) and of
expert parallelism (``--ep``): each bad layout refused in one line that names the fix, before any rank
starts. ``config.py`` calls :func:`check`; ``expert_strategy.py`` is what they protect."""


def check(cfg, need) -> None:
    """``need(condition, message)`` for every rule of an MoE or expert-parallel config."""
    need(cfg.ep == 1 or cfg.model == "gpt",
         "expert parallelism splits the experts of the GPT's mixture-of-experts MLPs: use --model gpt --experts E")
    need(cfg.ep == 1 or cfg.experts > 0, f"--ep {cfg.ep} splits experts the model does not have: add --experts E "
         f"(a multiple of {cfg.ep})")
    if not cfg.experts:
        return
    need(cfg.model == "gpt", "--experts replaces the GPT's MLPs by a mixture of experts: use --model gpt")
    need(1 <= cfg.top_k <= cfg.experts,
         f"top-k {cfg.top_k} must be between 1 and the number of experts ({cfg.experts}): use --top-k <= {cfg.experts}")
    need(0 < cfg.capacity_factor <= 64, f"capacity-factor must be in (0, 64], got {cfg.capacity_factor}")
    need(cfg.experts % cfg.ep == 0,
         f"ep {cfg.ep} must divide the experts ({cfg.experts}): choose an ep that divides {cfg.experts}")
    need(cfg.world_size % cfg.ep == 0,
         f"ep {cfg.ep} must divide the world size ({cfg.world_size}): use a world size that is a multiple of {cfg.ep}")
    need(cfg.strategy == "ddp" and cfg.tp == cfg.pp == cfg.cp == 1,
         "the mixture of experts trains with data parallelism (and --ep) across the world: use --strategy ddp, "
         "without --tp, --pp and --cp")
    need(cfg.amp != "fp16", "the load-balancing loss enters the gradient outside the loss that GradScaler scales: "
         "use --amp bf16 or off with --experts")
    need(not cfg.activation_checkpointing, "activation checkpointing is not wired for the mixture of experts: "
         "drop --activation-checkpointing or --experts")

