"""Airflow DAG example: the nightly adcloud HD-map build.

Copy this file into Airflow's ``dags/`` folder on a machine where adcloud is installed (or
point ``ADCLOUD_BIN`` at its ``adcloud`` command) and set the Airflow Variables
``adcloud_hdmap_bags`` (where new drives land) and ``adcloud_hdmap_map`` (the map URI).

The build is incremental, idempotent and atomic (see ``deploy/nightly/README.md``), so Airflow's
retries are safe: a retry after a failed or killed attempt finds the previous map version
current, takes the stale build lock over and processes exactly the drives still missing; a
retry after a success changes nothing. ``max_active_runs=1`` keeps runs from queueing up
behind the map's build lock.

Works with Airflow 2.4+ and 3.x (the imports below pick whichever is installed).
"""

from __future__ import annotations

import datetime as dt
import os
import shlex

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import DAG
except ImportError:  # Airflow 2
    from airflow import DAG
    from airflow.operators.bash import BashOperator

ADCLOUD = os.environ.get("ADCLOUD_BIN", "/opt/adcloud/.venv/bin/adcloud")
# Jinja templates, rendered by Airflow at run time from its Variables. They reach the command
# through the task's environment, quoted there, so that bash neither splits a path with a space
# nor runs what follows a ';' in a Variable; a glob goes to adcloud as written (it expands
# globs itself, in object stores too).
BAGS = "{{ var.value.get('adcloud_hdmap_bags', 's3://fleet-drives/incoming/') }}"
MAP = "{{ var.value.get('adcloud_hdmap_map', 's3://hd-maps/city') }}"

with DAG(
    dag_id="adcloud_hdmap_nightly",
    description="Nightly incremental HD-map build (adcloud hdmap build)",
    schedule="15 2 * * *",
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc),  # noqa: UP017 - Python < 3.11 workers
    catchup=False,
    max_active_runs=1,
    default_args={
        "owner": "maps",
        "retries": 2,
        "retry_delay": dt.timedelta(minutes=20),
        "execution_timeout": dt.timedelta(hours=8),
    },
    tags=["adcloud", "hdmap"],
) as dag:
    build = BashOperator(
        task_id="hdmap_build",
        bash_command=(
            f'{shlex.quote(ADCLOUD)} hdmap build --bags "$NIGHTLY_BAGS" --map "$NIGHTLY_MAP" '
            "--skip-bad-bags --trust-mtime"
        ),
        # not ADCLOUD_HDMAP_*: adcloud reads those as build settings
        env={"PYTHONUNBUFFERED": "1", "NIGHTLY_BAGS": BAGS, "NIGHTLY_MAP": MAP},
        append_env=True,
    )
