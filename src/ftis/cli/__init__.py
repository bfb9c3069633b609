"""The `ftis` command line. Thin: parse, configure logging, call the library, render results.

One module per group of verbs; this file only lists them, in the order `ftis --help` shows:

    runs.py        run, report               train; a run's report
    studies.py     compare, sweep            runs side by side; studies over seeds
    benchmarks.py  bench                     the benchmark suite (a source checkout)
    models.py      basemodels, models, presets
    exports.py     export, eval              a checkpoint as a model directory; its score
    checks.py      check, layers             a config checked as a run would; the layers
    common.py, resume.py, supervisor.py      what the verbs share
"""

from __future__ import annotations

import sys

import typer

from ftis.cli import benchmarks, checks, exports, models, runs, studies
from ftis.cli.common import console, ended

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=("ftis: collaborative GRPO post-training of different LLMs with F-TIS."),
)
app.command()(runs.run)
app.command()(runs.report)
app.command()(studies.compare)
app.command()(studies.sweep)
app.command()(benchmarks.bench)
app.add_typer(models.basemodels_app, name="basemodels")
app.add_typer(models.models_app, name="models")
app.command()(exports.export)
app.command()(checks.check)
app.command("eval")(exports.eval_)
app.command()(checks.layers)
app.command()(models.presets)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        ended(130)
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:
        ended(1)  # a Python error: its traceback is the message
        raise
