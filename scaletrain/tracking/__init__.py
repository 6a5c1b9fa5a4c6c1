"""Everything MLflow: a training run's record, its local journal, ``tracking sync``, evaluations, comparisons
and plots. Only rank 0 talks to the tracking store (other ranks get a no-op :class:`Tracker`), except each
node's system-metrics sampler.

* :mod:`~scaletrain.tracking.tracker` - :class:`Tracker`, the rank-0 API a job records its run with (create
  or resume, params, tags, metrics, artifacts, the end status); :func:`broadcast_run_id`;
* :mod:`~scaletrain.tracking.outbox` - a run's journal and sender as a pair, and the metric buffer;
* :mod:`~scaletrain.tracking.journal` - the local record ``<out_dir>/tracking/journal.jsonl`` and ``run.json``;
* :mod:`~scaletrain.tracking.sender` - the background thread that sends and retries while the server is down;
* :mod:`~scaletrain.tracking.sync` - ``scaletrain tracking sync``: upload what the server missed;
* :mod:`~scaletrain.tracking.store` - the store's URI, a client, fast-failing HTTP, MLflow-safe names,
  experiments, run names;
* :mod:`~scaletrain.tracking.records` - what an evaluation is called (``test.full.beam5.lp1.0.step1200``) and
  where its record lives (``eval`` writes them, ``compare`` reads them);
* :mod:`~scaletrain.tracking.evaluations` - each evaluation as a run nested under the training run;
* :mod:`~scaletrain.tracking.datasets` - the corpus as an ``mlflow.data`` dataset (a run's input, the split as
  its context);
* :mod:`~scaletrain.tracking.models` - checkpoints as logged models (metrics linked, the best tagged), exports
  in the Model Registry; :mod:`~scaletrain.tracking.checkpoint_models` - which model records a checkpoint
  calls for;
* :mod:`~scaletrain.tracking.provenance` - MLflow's source, git, user tags; the run's description tag;
* :mod:`~scaletrain.tracking.system_metrics` - one system-metrics sampler per node, outage-proof;
* :mod:`~scaletrain.tracking.plots` - a run's learning curves, expert usage, evaluation bars (matplotlib, Agg);
* :mod:`~scaletrain.tracking.compare` - ``scaletrain compare``: runs side by side, tables and a PNG. Import it
  as a module (``from scaletrain.tracking.compare import compare, load_runs``): its ``compare`` function is
  not re-exported here, where it would hide the module of the same name.

Layer: imports :mod:`scaletrain.errors` and :mod:`scaletrain.fileio` only; never the training loop, engines, models or data. mlflow, matplotlib and
torch (``broadcast_run_id``) are imported inside the functions that use them, so importing this package is
cheap. The training loop reaches it through :mod:`scaletrain.train.recorder`.
"""
from scaletrain.tracking.evaluations import EvaluationLogged, evaluation_runs, log_evaluation
from scaletrain.tracking.journal import CHECKPOINTS_FILE, JOURNAL, RUN_FILE, Journal, last_logged_step, read_journal
from scaletrain.tracking.outbox import Outbox
from scaletrain.tracking.plots import plot_eval_scores, plot_expert_usage, plot_learning_curves
from scaletrain.tracking.sender import Sender
from scaletrain.tracking.store import (DEFAULT_EXPERIMENT, default_run_name, default_tracking_uri, fast_failing_http,
                                       flatten_params, resolve_tracking_uri, safe_key, tracking_client)
from scaletrain.tracking.sync import SyncReport, sync_run
from scaletrain.tracking.system_metrics import NodeSystemMetrics, node_layout
from scaletrain.tracking.tracker import Tracker, broadcast_run_id

__all__ = [
    "CHECKPOINTS_FILE",
    "DEFAULT_EXPERIMENT",
    "JOURNAL",
    "RUN_FILE",
    "EvaluationLogged",
    "Journal",
    "NodeSystemMetrics",
    "Outbox",
    "Sender",
    "SyncReport",
    "Tracker",
    "broadcast_run_id",
    "default_run_name",
    "default_tracking_uri",
    "evaluation_runs",
    "fast_failing_http",
    "flatten_params",
    "last_logged_step",
    "log_evaluation",
    "node_layout",
    "plot_eval_scores",
    "plot_expert_usage",
    "plot_learning_curves",
    "read_journal",
    "resolve_tracking_uri",
    "safe_key",
    "sync_run",
    "tracking_client",
]
