"""Launchers for Google Cloud: TPU VMs and pod slices (`tpu.py`), GCP Batch jobs on GPU hosts (`batch.py`).

Each launcher builds one bash script out of `gcloud` commands and either prints it (`--dry-run`: the
exact script that would run) or runs it with `bash -euo pipefail`. Only the standard library is used, so
`python tpu/tpu_vm.py ...` works from a checkout with nothing installed; JAX is never imported.
"""
