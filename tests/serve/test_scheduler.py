import asyncio

from flashtree.engine.config import GenerationConfig
from flashtree.serve.scheduler import Job, Metrics, Scheduler
from tests.serve.fakes import ScriptedEngine


def run_jobs(engine, grace: float, n: int = 2):
    """Submits n jobs, shuts down with `grace`, returns each job's outcome."""

    async def main():
        scheduler = Scheduler(engine, queue_size=4, metrics=Metrics())
        jobs = [Job([1, 2, 3], GenerationConfig(max_new_tokens=500), timeout=60) for _ in range(n)]
        for job in jobs:
            scheduler.submit(job)
        await asyncio.to_thread(scheduler.shutdown, grace)
        outcomes = []
        for job in jobs:
            try:
                outcomes.append((await job.wait()).finish_reason)
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        return outcomes, scheduler

    return asyncio.run(main())


def test_shutdown_finishes_in_flight_work_within_the_grace_period(tiny_target):
    outcomes, scheduler = run_jobs(ScriptedEngine(tiny_target, script="short reply"), grace=5)
    assert outcomes == ["stop", "stop"]
    assert not scheduler.accepting


def test_shutdown_cancels_what_outlives_the_grace_period(tiny_target):
    engine = ScriptedEngine(tiny_target, script="word " * 400, delay=0.01)
    outcomes, _ = run_jobs(engine, grace=0.1)
    assert outcomes == ["cancelled", "APIError"]  # the running one stops, the waiting one never starts
    assert len(engine.results) == 1
