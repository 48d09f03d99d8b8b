"""A run in its workdir: the plan worked out once per launch (`plan.RunPlan`), the record the
launcher keeps there (`record`: file names, revisions, history), and the lease that keeps one
live run per workdir (`lease`). What `--dry_run` prints of it: olmo3.train.dry_run."""
