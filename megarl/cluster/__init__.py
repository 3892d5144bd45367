"""Starting a job's ranks and keeping it going: the launchers behind ``megarl train`` (local
torchrun, a Ray cluster, a Slurm allocation) and the elastic supervisor that restarts a job whose
rank died, from its latest intact checkpoint, on the ranks still available."""
