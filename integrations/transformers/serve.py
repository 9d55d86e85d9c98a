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
classes the server builds by name. Up to transformers 5.24 the server loads models in its
own process: ``ModelManager`` (loads the models) becomes a subclass that enables the
integration right after loading, and ``GenerationState`` a subclass that is remembered, so
that its CB worker thread is stopped when the server stops (transformers' own ``serve
--continuous-batching`` leaves it running and never exits on Ctrl+C). From 5.25 each model
loads in a ``spawn``ed process of its own, through a pickled copy of the server's
``ModelLoader``: that becomes :class:`BreakgraphModelLoader`, defined in this module (made on
first use, since only 5.25 has its base) so that the copy finds it by name there, carrying
the launcher's options; its ``_load_model`` enables the integration in the model's process,
which prints its stats when transformers stops it (``SIGTERM``, at the server's shutdown).
The replacements go through :class:`breakgraph.patches.PatchSet` and are listed, with the
probe that guards them (:func:`.compat.serve_layout`), in :mod:`.compat` ("serve"). The
model must be given (``MODEL``): a pinned model is never unloaded, so the integration lives
exactly as long as the server.

Install: ``pip install "breakgraph[serve]"`` (transformers' serving extras, and
``requests``, which transformers' CLI imports but its ``serving`` extra does not install).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

__all__ = ["main"]


def _buckets(text: str) -> tuple[int, ...]:
    """``--query-buckets 8,16,64``: positive ints, refused before the server loads anything."""
    from breakgraph.buckets import validate_buckets
    from breakgraph.errors import InputError

    try:
        return tuple(validate_buckets([int(b) for b in text.split(",")], "--query-buckets"))
    except (ValueError, InputError) as exc:
        message = f"{text!r}: comma-separated positive ints ({exc})"
        raise argparse.ArgumentTypeError(message) from None


def _parser() -> argparse.ArgumentParser:
    prog = "python -m breakgraph.integrations.transformers.serve"
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} MODEL [--backend {{cuda,emulated}}] [--attention {{auto,flash,reference}}] "
        "[--query-buckets 8,16,64,...] [options of `transformers serve`]",
        description="transformers serve --continuous-batching, with breakgraph's continuous "
        "batching enabled on the served model.",
        epilog="Other options go to `transformers serve` (see `transformers serve --help`).",
        add_help=True,
    )
    parser.add_argument("--backend", choices=("cuda", "emulated"), default=None)
    parser.add_argument("--attention", choices=("auto", "flash", "reference"), default="auto")
    parser.add_argument(
        "--query-buckets",
        type=_buckets,
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

    if "--continuous-batching" not in rest:  # first: a trailing option keeps its own error
        rest.insert(0, "--continuous-batching")
    buckets = ours.query_buckets

    from breakgraph.patches import PatchSet

    from . import serve as here  # this module by its name, also when run as __main__

    options = dict(backend=ours.backend, attention=ours.attention, query_buckets=buckets)
    states = []
    manager_module, state_module, app = compat.serving()
    layout = compat.serve_layout(manager_module)  # not None: the probe above passed
    loader_class = here.BreakgraphModelLoader if layout == "model process" else None

    class PinnedModelManager(manager_module.ModelManager):
        """transformers' ModelManager, refusing to start without the model to serve."""

        def __init__(self, *args, force_model=None, **kwargs):
            if force_model is None:
                raise SystemExit(
                    "python -m breakgraph.integrations.transformers.serve: give the model to serve "
                    "(e.g. `... serve Qwen/Qwen3-0.6B`)."
                )
            super().__init__(*args, force_model=force_model, **kwargs)

    patches = PatchSet()
    if layout == "in process":

        class BreakgraphModelManager(PinnedModelManager):
            """The pinned ModelManager, enabling breakgraph CB on every model it loads, in the
            server's own process (transformers up to 5.24)."""

            def _load_model(self, *args, **kwargs):
                model = super()._load_model(*args, **kwargs)
                here._enable(model, options)
                return model

        class StoppableGenerationState(state_module.GenerationState):
            """transformers' GenerationState, remembered so its CB worker can be stopped at
            exit (transformers' server leaves it running: the process never exits on Ctrl+C)."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                states.append(self)

        patches.attribute(manager_module, "ModelManager", BreakgraphModelManager)
        patches.attribute(state_module, "GenerationState", StoppableGenerationState)
    elif layout == "model process":  # the loader's copy in the model's process enables it
        patches.attribute(manager_module, "ModelManager", PinnedModelManager)
        patches.attribute(manager_module, "ModelLoader", loader_class)
    try:
        here._OPTIONS = options
        app.main(args=["serve", *rest], prog_name="transformers", standalone_mode=False)
    except click.exceptions.Abort:
        pass  # Ctrl+C: uvicorn has shut the server down
    except click.exceptions.ClickException as exc:  # a usage error: as `transformers serve`
        exc.show()  # reports it (standalone_mode=False leaves it to us: it was a traceback)
        return exc.exit_code
    finally:
        patches.restore()
        for state in states:
            state.shutdown()  # stop the CB worker thread
        for handle in here._HANDLES:
            print(f"breakgraph: served steps per query bucket:\n{handle.stats}", flush=True)
            handle.disable()
        here._HANDLES.clear()
        here._OPTIONS = {}
    return 0


#: what :func:`main` enables the served model with; :class:`BreakgraphModelLoader` copies it into
#: each instance, so that the copy pickled into a model's process carries it
_OPTIONS: dict = {}
#: the handles of this process's enabled models (alive as long as the model is served)
_HANDLES: list = []


def _enable(model, options: dict):
    """Enable breakgraph's continuous batching on a model the server has just loaded; the
    handle is kept in :data:`_HANDLES` and returned."""
    from .continuous_batching import enable_continuous_batching

    handle = enable_continuous_batching(model.eval(), options["backend"],
                                        attention=options["attention"],
                                        query_buckets=options["query_buckets"])  # fmt: skip
    _HANDLES.append(handle)
    print(f"breakgraph: continuous batching enabled: {handle!r}", flush=True)
    return handle


def _report_when_terminated(handle) -> None:
    """In a model's process (transformers 5.25 on): print the handle's stats when transformers
    stops the process (``SIGTERM``, at the server's shutdown), then end as ``SIGTERM`` would have.
    Only from the process's main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def report(signum, frame):
        print(f"breakgraph: served steps per query bucket:\n{handle.stats}", flush=True)
        signal.signal(signal.SIGTERM, previous)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, report)


def __getattr__(name: str):
    """``BreakgraphModelLoader``, made on first use: a subclass of transformers' ``ModelLoader``
    (5.25 on), which exists only where that release is installed. A module attribute, so that
    pickle finds it by name in the model's process the server spawns (importing this module
    there and asking for it)."""
    if name != "BreakgraphModelLoader":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import compat

    try:  # only that module: this runs in every model process
        model_manager = compat.serving_model_manager()
    except ImportError as exc:  # no serving extras: the attribute does not exist (hasattr: False)
        raise AttributeError(f"{name}: transformers serve cannot be imported ({exc})") from exc

    class BreakgraphModelLoader(model_manager.ModelLoader):
        """transformers' ModelLoader (5.25 on), enabling breakgraph CB on the model it loads in
        the model's own process."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.breakgraph_options = dict(_OPTIONS)

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs)
            _report_when_terminated(_enable(model, self.breakgraph_options))
            return model

    BreakgraphModelLoader.__qualname__ = name  # pickle looks it up by this name
    globals()[name] = BreakgraphModelLoader
    return BreakgraphModelLoader


if __name__ == "__main__":
    sys.exit(main())
