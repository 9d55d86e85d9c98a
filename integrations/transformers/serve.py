"""``transformers serve --continuous-batching`` with breakgraph's continuous batching.

::

    python -m breakgraph.integrations.transformers.serve MODEL [--backend cuda|emulated]
        [--attention auto|flash|reference] [--query-buckets 8,16,64,...]
        [any option of `transformers serve`, e.g. --port 8000 --cb-max-batch-tokens 2048]

It runs transformers' own server (``transformers serve``, OpenAI-compatible
``/v1/completions``, ``/v1/chat/completions``, ...) pinned to ``MODEL`` with
continuous batching on, and enables :func:`~.continuous_batching.enable_continuous_batching`
on the model as soon as the server has loaded it. Every CB step of the server then
replays breakable graphs; the stats are printed when the server stops.

Why a launcher and not ``transformers serve --attn-implementation breakgraph_paged``:
the CLI accepts only its built-in attention names, and the server loads its models
itself. The launcher therefore swaps, for the duration of the server and no longer,
two classes the server builds by name: ``ModelManager`` (loads the models) for a
subclass that enables the integration right after loading, and ``GenerationState``
for a subclass that is remembered, so that its CB worker thread is stopped when the
server stops (transformers' own ``serve --continuous-batching`` leaves it running and
never exits on Ctrl+C). Both replacements go through :class:`breakgraph.patches.PatchSet`
and are listed, with the probe that guards them, in :mod:`.compat` ("serve"). The model
must be given (``MODEL``): a pinned model is never unloaded, so the integration lives
exactly as long as the server.

Install: ``pip install "breakgraph[serve]"`` (transformers' serving extras, and
``requests``, which transformers' CLI imports but its ``serving`` extra does not install).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m breakgraph.integrations.transformers.serve",
        description="transformers serve --continuous-batching, with breakgraph's continuous "
        "batching enabled on the served model.",
        epilog="Other options go to `transformers serve` (see `transformers serve --help`).",
        add_help=True,
    )
    parser.add_argument("--backend", choices=("cuda", "emulated"), default=None)
    parser.add_argument("--attention", choices=("auto", "flash", "reference"), default="auto")
    parser.add_argument(
        "--query-buckets",
        default=None,
        help="comma-separated query-token buckets (default: 32, 128, 512, ...)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    ours, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    from . import compat

    missing = compat.problems("serve")
    if missing:  # extras absent, or a release whose serve lacks what the launcher subclasses
        who = "python -m breakgraph.integrations.transformers.serve"
        print(
            f"{compat.unsupported_message('serve', who, missing)} "
            f'pip install "breakgraph[serve]" installs one with the serving extras.',
            file=sys.stderr,
        )
        return 2
    if "--no-continuous-batching" in rest:
        print("this launcher always serves with --continuous-batching", file=sys.stderr)
        return 2
    import click

    if "--continuous-batching" not in rest:
        rest.append("--continuous-batching")
    buckets = None
    if ours.query_buckets:
        buckets = tuple(int(b) for b in ours.query_buckets.split(","))

    from breakgraph.patches import PatchSet

    from .continuous_batching import enable_continuous_batching

    handles, states = [], []
    manager_module, state_module, app = compat.serving()
    original_manager, original_state = manager_module.ModelManager, state_module.GenerationState

    class BreakgraphModelManager(original_manager):
        """transformers' ModelManager, enabling breakgraph CB on every model it loads."""

        def __init__(self, *args, force_model=None, **kwargs):
            if force_model is None:
                raise SystemExit(
                    "python -m breakgraph.integrations.transformers.serve: give the model to serve "
                    "(e.g. `... serve Qwen/Qwen3-0.6B`)."
                )
            super().__init__(*args, force_model=force_model, **kwargs)

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs).eval()
            handles.append(
                enable_continuous_batching(
                    model, ours.backend, attention=ours.attention, query_buckets=buckets
                )
            )
            print(f"breakgraph: continuous batching enabled: {handles[-1]!r}", flush=True)
            return model

    class StoppableGenerationState(original_state):
        """transformers' GenerationState, remembered so its CB worker can be stopped at exit
        (transformers' server leaves it running: the process never exits on Ctrl+C)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            states.append(self)

    patches = PatchSet()
    patches.attribute(manager_module, "ModelManager", BreakgraphModelManager)
    patches.attribute(state_module, "GenerationState", StoppableGenerationState)
    try:
        app.main(args=["serve", *rest], prog_name="transformers", standalone_mode=False)
    except click.exceptions.Abort:
        pass  # Ctrl+C: uvicorn has shut the server down
    finally:
        patches.restore()
        for state in states:
            state.shutdown()  # stop the CB worker thread
        for handle in handles:
            print(f"breakgraph: served steps per query bucket:\n{handle.stats}", flush=True)
            handle.disable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
