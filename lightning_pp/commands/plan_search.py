"""``lightning-pp plan CONFIG --search``: profile the model, search pipeline shapes, recommend.

Measures the config's model layer by layer on this process (or loads ``--profile FILE.json``),
enumerates every shape for ``--devices N`` processes at the config's global batch, predicts each
one's step time and peak memory (:mod:`lightning_pp.planner`), prints the top ``--top`` and the
chosen one, and with ``--write FILE.yaml`` writes a run file ``lightning-pp fit`` accepts.

Example::

    lightning-pp plan configs/demo_cpu.yaml --search --devices 4 --write runs/planned.yaml
    lightning-pp plan configs/demo_cpu.yaml --search --profile prof.json --memory-per-device 2GiB
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from lightning_pp.commands._common import check_run, fail
from lightning_pp.commands.config import ConfigError, RunConfig
from lightning_pp.commands.launch import detect_launch_environment

__all__ = ["add_search_options", "candidate_sizes", "run_search"]


def add_search_options(p: argparse.ArgumentParser) -> None:
    """The ``--search`` options of ``lightning-pp plan``."""
    both = p.add_argument_group("memory (the dry run and --search)")
    both.add_argument(
        "--memory-per-device",
        default=None,
        help="e.g. 80GiB: the dry run says whether each sharding fits, --search drops what "
        "exceeds it (default: planner.memory_per_device)",
    )
    both.add_argument(
        "--optimizer",
        default=None,
        help="optimizer-state model: adam|adamw|sgd-momentum|sgd (default: planner.optimizer, "
        "else adam)",
    )
    both.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks per stage: the same as the override strategy.tp=N (the dry "
        "run prints per-rank bytes at it; --search tries tp 1, 2, 4, 8 either way)",
    )
    g = p.add_argument_group("search (--search)")
    g.add_argument("--search", action="store_true", help="profile, search shapes, recommend one")
    added: list[argparse.Action] = []

    def opt(*names: str, **kw: Any) -> None:
        added.append(g.add_argument(*names, **kw))

    opt("--devices", type=int, default=None, help="world size to plan for")
    opt("--profile", default=None, metavar="FILE.json", help="use this profile")
    opt("--save-profile", default=None, metavar="FILE.json", help="save the profile")
    opt("--cache-dir", default=None, help="profile cache (~/.cache/lightning_pp)")
    opt("--top", type=int, default=10, help="rows of the table (default 10)")
    opt("--write", default=None, metavar="FILE.yaml", help="write the chosen config")
    opt("--repeats", type=int, default=3, help="timed runs per layer (fastest kept)")
    opt("--max-microbatches", type=int, default=64, help="largest m tried")
    opt("--latency", type=float, default=None, help="P2P latency, seconds")
    opt("--bandwidth", type=float, default=None, help="P2P bandwidth, bytes/s")
    opt("--overhead", type=float, default=None, help="engine cost per action, s")
    opt(
        "--cores",
        type=int,
        default=None,
        help="CPU cores the processes share (default: this machine's, for a CPU profile; 0: "
        "do not model oversubscription)",
    )
    opt(
        "--calibrate",
        action="store_true",
        help="run the config's shape first; fit the per-action overhead and hop latency",
    )
    opt("--verify", type=int, default=0, metavar="K", help="run the top K and the config's shape")
    opt("--verify-steps", type=int, default=3, help="timed steps per run (3)")
    opt("--verify-warmup", type=int, default=2, help="warm-up steps per run (2)")
    opt("--verify-timeout", type=float, default=300.0, help="seconds per run (300)")
    # Kept so that plan without --search can refuse them: they would be silently unused.
    p.set_defaults(_search_only=tuple((a.option_strings[0], a.dest, a.default) for a in added))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_sizes(world: int, global_batch: int, max_microbatches: int | None) -> list[int]:
    """Every microbatch size a search over ``world`` processes can ask for (what to profile)."""
    sizes = set()
    for pp in _divisors(world):
        dp = world // pp
        if global_batch % dp:
            continue
        per = global_batch // dp
        for m in _divisors(per):
            if max_microbatches is None or m <= max_microbatches:
                sizes.add(per // m)
    return sorted(sizes)


def _global_batch(cfg: RunConfig, dp: int) -> int | None:
    data = cfg.get("data") or {}
    args = (data.get("init_args") or {}) if "class_path" in data else data
    batch = args.get("batch_size")
    return batch * dp if isinstance(batch, int) and not isinstance(batch, bool) else None


def check_search_flags(args: argparse.Namespace) -> str | None:
    """The message for a search flag that cannot work, before anything is profiled, else
    ``None``. (``--top 0`` printed one row and ``--max-microbatches 0`` left no candidate,
    reported with an empty reason.)"""
    if args.devices is not None and args.devices < 1:
        # Checked before the config's world could stand in for it: 0 is not "unset".
        return (
            f"--devices {args.devices}: the search needs a world of at least 1 process; give "
            f"--devices N with N >= 1 (or leave it out to search the config's world size)"
        )
    numbers = [
        ("--bandwidth", args.bandwidth, 0.0, False, "bytes/s, e.g. 1e10"),
        ("--latency", args.latency, 0.0, True, "seconds, e.g. 2e-5"),
        ("--overhead", args.overhead, 0.0, True, "seconds per action, e.g. 5e-5"),
        ("--repeats", args.repeats, 1, True, "timed runs per layer"),
        ("--cores", args.cores, 0, True, "0 turns the oversubscription model off"),
        ("--verify", args.verify, 0, True, "0 runs nothing"),
        ("--verify-steps", args.verify_steps, 1, True, "timed steps per run"),
        ("--verify-warmup", args.verify_warmup, 0, True, "warm-up steps per run"),
        ("--verify-timeout", args.verify_timeout, 0.0, False, "seconds per run"),
    ]
    for flag, value, low, inclusive, what in numbers:
        if value is not None and (value < low if inclusive else value <= low):
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            # --bandwidth 0 ended in a ZeroDivisionError traceback inside the cost model
            return f"{flag} {value:g}: must be {bound} ({what})"
    if args.top < 1:
        return (
            f"--top {args.top}: the table of ranked shapes needs at least one row; give "
            f"--top N with N >= 1 (default 10)"
        )
    if args.max_microbatches is not None and args.max_microbatches < 1:
        return (
            f"--max-microbatches {args.max_microbatches}: every shape runs at least one "
            f"microbatch per step, so no candidate is left; give --max-microbatches N with "
            f"N >= 1 (default 64)"
        )
    return None


def _state_bytes(memory: Any) -> Any:
    """Bytes per parameter of each training state: from ``trainer.precision`` when the run
    file sets it (``bf16-true``: bf16 parameters, fp32 master weights and Adam states), else
    ``None`` (the profile's own dtype, no master weight)."""
    from lightning_pp.planner.sharding import StateBytes

    if memory.precision is None:
        StateBytes.for_precision(None, memory.optimizer)  # refuses an unknown optimizer
        return None
    return StateBytes.for_precision(memory.precision, memory.optimizer)


def _bucket_cap_mb(checked: Any) -> float:
    """The run's gradient bucket size (the ``zero`` padding follows its buckets)."""
    from lightning_pp.planner.sharding import DEFAULT_BUCKET_CAP_MB

    plan = checked.plan
    cap = plan.bucket_cap_mb if plan is not None else None
    return float(cap) if cap else DEFAULT_BUCKET_CAP_MB


def tp_shares(
    cfg: RunConfig, checked: Any, world: int, state_bytes: Any
) -> tuple[tuple[int, ...], dict[int, list[Any]], list[str]]:
    """(the tensor-parallel sizes to search, each layer's share on one tp rank at each
    ``tp > 1``, a line per size left out and why): every size of
    :data:`~lightning_pp.planner.tensor_parallel.TP_CANDIDATES` that divides ``world`` and the
    model's heads, KV heads, hidden, FFN and vocabulary sizes, for a model whose
    ``pipeline_tensor_parallel`` hook shards its layers; measured on the meta device from one
    sample (:func:`~lightning_pp.planner.tensor_parallel.tp_layers`)."""
    import torch

    from lightning_pp.commands.config import instantiate
    from lightning_pp.layout.rules import PreflightError
    from lightning_pp.planner.meta_profile import example_input, meta_layers, tied_groups
    from lightning_pp.planner.tensor_parallel import (
        TP_CANDIDATES,
        check_model_tp,
        record_tp_styles,
        tp_layers,
    )

    info = checked.model_info
    module = None if info is None else info.module
    if module is None or not callable(getattr(module, "pipeline_layers", None)):
        return (1,), {}, ["tp: only 1 (the model has no pipeline_layers() to shard)"]
    layers = meta_layers(module)
    dtype = {2: torch.bfloat16, 8: torch.float64}.get(getattr(state_bytes, "param", 4))
    tps, shares, notes = [1], {}, []
    x0 = None
    for tp in TP_CANDIDATES[1:]:
        if world % tp:
            notes.append(f"tp={tp}: world {world} % tp {tp} = {world % tp}")
            continue
        try:
            note = check_model_tp(module, layers, tp)
        except PreflightError as err:
            notes.append(f"tp={tp}: {err}")
            continue
        if note is not None:
            notes.append(f"tp={tp} and more: {note}")
            break
        styles = record_tp_styles(module, layers, tp)
        assert styles is not None
        try:
            if x0 is None:
                x0 = example_input(module, cfg.get("data"), 1, instantiate)
            cast = [layer.to(dtype) for layer in layers] if dtype is not None else layers
            shares[tp] = tp_layers(cast, styles, x0, tp, tied_groups(module))
        except Exception as err:  # a data module or layer that cannot run on meta: say which
            notes.append(f"tp={tp}: not measured on the meta device ({type(err).__name__}: {err})")
            continue
        tps.append(tp)
    return tuple(tps), shares, notes


def _comm_name(candidate: Any) -> str:
    """What the data-parallel communication of ``candidate`` is."""
    if candidate.fsdp:
        return "all-gather + reduce-scatter"
    return "reduce-scatter + all-gather" if candidate.zero else "all-reduce"


def run_search(cfg: RunConfig, args: argparse.Namespace, command: str = "plan") -> int:
    """The ``--search`` report; 0, or 2 with a message."""
    from omegaconf import OmegaConf

    from lightning_pp.commands.config import instantiate
    from lightning_pp.commands.plan_memory import memory_settings
    from lightning_pp.layout.recompute_spec import format_bytes
    from lightning_pp.planner import (
        ModelProfile,
        SearchError,
        SearchSpace,
        chosen_config,
        format_table,
        search,
    )
    from lightning_pp.planner.profiler import profile_config
    from lightning_pp.planner.search import describe_memory, describe_shape

    started = time.perf_counter()
    flag_error = check_search_flags(args)
    if flag_error is not None:
        return fail(command, flag_error)
    try:
        checked = check_run(cfg, detect_launch_environment(), model="require", this_machine=False)
    except ConfigError as err:
        return fail(command, str(err))
    world = args.devices if args.devices is not None else checked.world
    if world is None or world < 1:
        return fail(command, "--search needs the world size: give --devices N (N >= 1)")
    dp_now = checked.plan.dp if checked.plan is not None and checked.plan.dp else 1
    global_batch = _global_batch(cfg, dp_now)
    if global_batch is None:
        return fail(command, "--search needs data.init_args.batch_size (an integer) in the config")
    try:
        memory = memory_settings(cfg, args)
        state_bytes = _state_bytes(memory)
    except (ConfigError, ValueError) as err:  # a size that does not parse, an unknown optimizer
        return fail(command, str(err))
    budget = memory.limit
    if args.profile:
        try:
            profile = ModelProfile.load(args.profile)
        except (OSError, ValueError) as err:
            return fail(command, f"--profile {args.profile}: {err}")
        source = f"loaded {args.profile}"
    else:
        sizes = candidate_sizes(world, global_batch, args.max_microbatches)
        profile = profile_config(
            cfg,
            sizes,
            cache_dir=args.cache_dir,
            repeats=args.repeats,
            world=world,
            instantiate=instantiate,
        )
        source = f"measured on {profile.device} (microbatch sizes {profile.sizes}"
        source += "".join(f"; {n}" for n in profile.notes) + ")"
    profile = profile.with_links(
        latency_s=args.latency, bandwidth=args.bandwidth, overhead_s=args.overhead
    )
    cores = args.cores
    if cores is None and profile.device == "cpu":
        cores = os.cpu_count()
    verifying = args.verify > 0 or args.calibrate
    if verifying and profile.device != "cpu":
        return fail(
            command, f"--verify/--calibrate run on CPU only; the profile is {profile.device}"
        )
    calibrated = config_run = None
    shape = None
    if verifying:
        from lightning_pp.commands.plan_verify import calibrate, config_shape

        shape = config_shape(cfg, profile, world, global_batch)
    if args.calibrate:
        assert shape is not None
        cal, config_run, cal_msg = calibrate(cfg, profile, shape, args, world)
        if cal is not None:
            calibrated = cal_msg
            profile = profile.with_links(
                latency_s=cal.latency_s if args.latency is None else None,
                overhead_s=cal.overhead_s if args.overhead is None else None,
                compute_scale=cal.compute_scale,
                receive_s=cal.receive_s,
                bandwidth=cal.bandwidth if args.bandwidth is None else None,
            )
        else:
            calibrated = cal_msg
    if args.save_profile:
        profile.save(args.save_profile)
        source += f", saved to {args.save_profile}"
    if checked.model_info is not None and checked.model_info.num_layers not in (
        None,
        profile.num_layers,
    ):
        return fail(
            command,
            f"the profile has {profile.num_layers} layers but the model has "
            f"{checked.model_info.num_layers}: profile this config (drop --profile)",
        )
    tps, shares, tp_notes = tp_shares(cfg, checked, world, state_bytes)
    try:
        result = search(
            profile,
            world,
            global_batch,
            memory_per_device=budget,
            space=SearchSpace(
                max_microbatches=args.max_microbatches,
                bucket_cap_mb=_bucket_cap_mb(checked),
                tps=tps,
            ),
            optimizer=memory.optimizer,
            cores=cores or None,
            state_bytes=state_bytes,
            tp_layers=shares,
        )
    except SearchError as err:
        return fail(command, str(err))
    except ValueError as err:  # e.g. an unknown --optimizer
        return fail(command, str(err))
    best = result.best
    out = [
        f"config: {cfg.path}",
        f"profile: {profile.num_layers} layers, {source}; P2P latency "
        f"{profile.latency_s * 1e6:.0f} us, bandwidth {profile.bandwidth / 1e9:.2f} GB/s, "
        f"engine overhead {profile.overhead_s * 1e3:.2f} ms per action"
        + (
            f"; {world} processes on {cores} cores: step >= world compute / cores"
            if cores and world > cores
            else ""
        ),
        *([calibrated] if calibrated else []),
        f"search: world {world}, global batch {global_batch}: {result.considered} candidates "
        f"({len(result.ranked)} fit"
        + (f" in {format_bytes(budget)} ({memory.limit_source})" if budget is not None else "")
        + f", {len(result.over_memory)} over memory, {len(result.rejected)} shapes refused by "
        f"the plan rules) in {result.seconds:.2f} s ({result.cpu_seconds:.2f} s CPU)",
        f"tensor parallel: tp {', '.join(map(str, tps))} searched"
        + "".join(f"; {n}" for n in tp_notes),
        "",
        format_table(result.ranked[: max(1, args.top)]),
        "",
        f"chosen: {describe_shape(best.candidate)}",
        f"  predicted step {best.step_s * 1e3:.1f} ms (pipeline {best.makespan_s * 1e3:.1f} ms"
        + (f" + oversubscription {best.contention_s * 1e3:.1f} ms" if best.contention_s else "")
        + f" + dp {_comm_name(best.candidate)} {best.allreduce_s * 1e3:.1f} ms), bubble "
        f"{100 * best.bubble:.1f}%, "
        f"peak memory on pipeline rank {best.heaviest.rank} {describe_memory(best.heaviest)}",
    ]
    if args.write:
        data = chosen_config(cfg.data, best, world=world)
        os.makedirs(os.path.dirname(os.path.abspath(args.write)), exist_ok=True)
        with open(args.write, "w") as f:
            f.write(f"# written by: lightning-pp plan {cfg.path} --search --devices {world}\n")
            f.write(OmegaConf.to_yaml(OmegaConf.create(data)))
        out.append(f"wrote {args.write} (train it with: lightning-pp fit {args.write})")
    if args.verify > 0:
        from lightning_pp.commands.plan_verify import verify
        from lightning_pp.planner.search import predict

        assert shape is not None

        def predict_config():
            return predict(
                profile,
                shape.candidate,
                shape.plan,
                optimizer=memory.optimizer,
                cores=cores or None,
                state_bytes=state_bytes,
            )

        print("\n".join(out))
        sys.stdout.flush()
        out = ["", verify(cfg, result, shape, args, world, predict_config, config_run)]
    out.append(f"plan --search took {time.perf_counter() - started:.1f} s")
    print("\n".join(out))
    sys.stdout.flush()
    return 0
