"""Studies: a grid of ordinary runs described in one YAML file, run sequentially with resume,
summarised into a results document (docs/RESULTS.md). See studies/paper.yaml."""

from ftis.study.results import write_results
from ftis.study.runner import SweepOutcome, plan, run_status, run_study
from ftis.study.spec import RunSpec, Study, StudyError, load_study

__all__ = [
    "RunSpec",
    "Study",
    "StudyError",
    "SweepOutcome",
    "load_study",
    "plan",
    "run_status",
    "run_study",
    "write_results",
]
