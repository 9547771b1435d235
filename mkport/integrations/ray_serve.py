"""Ray Serve: the `mkport serve` app as a Ray Serve deployment, one replica per GPU, with Ray's proxy doing
the routing and autoscaling (pip install -e '.[ray]'). `mkport serve` stays the single-GPU path.

    import ray
    from ray import serve
    from mkport.integrations.ray_serve import deployment
    from mkport.serve.config import ServeConfig

    ray.init()
    serve.run(deployment(ServeConfig(folder="/models/Qwen3-TTS-12Hz-1.7B-CustomVoice", model_id="qwen3-tts-1.7b"),
                         num_replicas=4), route_prefix="/")

Each replica builds its own app and engine (model, decoder pairs, scheduler) on its GPU; Ray sends a replica
at most `max_streams` requests at once and queues the rest at its proxy. A replica that failed to load
reports itself unhealthy, so Ray replaces it.
"""

from __future__ import annotations

from ..serve.config import ServeConfig


def deployment(config: ServeConfig, *, num_replicas: int | str = 1, gpus_per_replica: float | None = None,
               **options):
    """A bound Ray Serve application of `config`; `num_replicas` may be "auto" (Ray's autoscaling).
    `gpus_per_replica` defaults to 1 for the megakernel backend and 0 for the reference one; `options` go
    to Ray's Deployment.options (autoscaling_config, max_queued_requests, ...)."""
    from ray import serve

    @serve.deployment
    @serve.ingress()
    class MkportServe:
        def __init__(self, config: ServeConfig):
            self.config = config
            self.engine = None

        def __serve_build_asgi_app__(self):
            from mkport.serve.app import create_app  # absolute: this class travels to the replica by value
            from mkport.serve.engine import Engine

            self.engine = Engine(self.config)
            return create_app(self.engine)  # its lifespan starts the engine: load and warm-up in the background

        def check_health(self) -> None:
            if self.engine is not None and self.engine.error:
                raise RuntimeError(self.engine.error)

    gpus = gpus_per_replica if gpus_per_replica is not None else (1 if config.backend == "megakernel" else 0)
    return MkportServe.options(num_replicas=num_replicas, ray_actor_options={"num_gpus": gpus},
                               max_ongoing_requests=config.max_streams, **options).bind(config)
