# slurm/lib/preempt.sh — the batch shell's part in preemption, sourced (not run) by
# slurm/pretrain.sbatch, slurm/torchrun.sbatch and slurm/mpirun.sbatch.
#
# A preempted or time-limited job gets SIGTERM (preemption) or the warning signal
# (--signal=[B:]USR2@120). The ranks stop at an agreed step, checkpoint and requeue the
# job themselves (hpc.preempt); the batch shell's part is to
#   * outlive the signal: run the step in the background, trap TERM and USR2, and keep
#     waiting for the step (a template that execs its launcher dies with the shell);
#   * tell the ranks, where its launcher does not pass the signal on (mpirun), by
#     writing the signal's name into HPC_STOP_FILE, which PreemptGuard polls;
#   * requeue the job for ranks that have no scontrol (containers): rank 0 writes the
#     job id into HPC_REQUEUE_MARKER and this shell runs `scontrol requeue`.
# Both files are per job, in the submit directory (seen by every node), and removed at
# the start of every run so a requeued run does not read the previous run's.
#
# Use, in a template that runs under `set -euo pipefail`:
#   hpc_preempt_setup [--stop-file]   export the marker (and the stop file), trap
#   LAUNCHER ... &                    the step, in the background (not exec)
#   hpc_preempt_wait $!               wait for it through the signals; RC = its status
#   ...                               what must run before the job ends (a requeue may
#                                     end this shell at once); hpc_preempt_requeued
#                                     tells a requeue (a normal end) from a failure
#   hpc_preempt_requeue               requeue if the ranks asked for it
#   exit "$RC"

# Before the step: export HPC_REQUEUE_MARKER (and, with --stop-file, HPC_STOP_FILE),
# remove what an earlier run of this job left there, and trap TERM and USR2.
hpc_preempt_setup() {
    hpc_preempt_stop_file=0
    case "${1:-}" in
        "") ;;
        --stop-file) hpc_preempt_stop_file=1 ;;
        *) echo "hpc: hpc_preempt_setup got '$1', expected no argument or --stop-file" >&2
           return 2 ;;
    esac
    local dir=${SLURM_SUBMIT_DIR:-$PWD}
    export HPC_REQUEUE_MARKER="$dir/.hpc-requeue-${SLURM_JOB_ID}"
    rm -f "$HPC_REQUEUE_MARKER"
    if [ "$hpc_preempt_stop_file" = 1 ]; then
        export HPC_STOP_FILE="$dir/.hpc-stop-${SLURM_JOB_ID}"
        rm -f "$HPC_STOP_FILE"
    fi
    trap 'hpc_preempt_signal TERM' TERM
    trap 'hpc_preempt_signal USR2' USR2
}

# The trap: the shell goes on waiting; with the stop file, the ranks learn of the signal.
hpc_preempt_signal() {
    if [ "$hpc_preempt_stop_file" = 1 ]; then
        echo "$1" > "$HPC_STOP_FILE"
        echo "hpc: batch shell got SIG$1: told the ranks ($HPC_STOP_FILE)" >&2
    else
        echo "hpc: batch shell got SIG$1: waiting for the ranks to checkpoint" >&2
    fi
}

# Wait for the step (pid $1) to end: a trapped signal ends `wait` early, so wait again
# while it runs. Sets RC to the step's exit status; removes the stop file.
hpc_preempt_wait() {
    until wait "$1"; RC=$?; ! kill -0 "$1" 2>/dev/null; do :; done
    if [ "$hpc_preempt_stop_file" = 1 ]; then rm -f "$HPC_STOP_FILE"; fi
}

# True when the step ended with the ranks' agreed exit after a requeue: every rank exits
# 75 (EX_TEMPFAIL, hpc.preempt.requeue.EXIT_REQUEUED) once the job is requeued, or handed
# to this shell to requeue. A normal end, not a failure to report.
hpc_preempt_requeued() {
    [ "${RC:-}" = 75 ]
}

# After the step: requeue the job named in the marker (rank 0 writes it when it has no
# scontrol where it runs). Says so once scontrol did it; when it failed, prints
# scontrol's words and sets RC=1 (the job ends failed, not requeued).
hpc_preempt_requeue() {
    if [ -s "$HPC_REQUEUE_MARKER" ]; then
        local job said status=0
        job=$(cat "$HPC_REQUEUE_MARKER"); rm -f "$HPC_REQUEUE_MARKER"
        said=$(scontrol requeue "$job" 2>&1) || status=$?
        if [ "$status" = 0 ]; then
            echo "hpc: requeued job ${job} for the ranks (no scontrol where they run)"
        else
            echo "hpc: \`scontrol requeue ${job}\` failed: ${said:-exit status $status}" >&2
            echo "The ranks checkpointed and asked this batch shell to requeue the job; only batch jobs that allow requeueing can be requeued." >&2
            echo "HINT: submit with sbatch --requeue (the templates ask for it), or resubmit the same command: it resumes from the run directory." >&2
            RC=1
        fi
    fi
}
