"""``asgi_idempotency.integrations`` imports no broker package until a preset is imported."""

from __future__ import annotations

from tests.helpers._blocking import run_without


def test_the_package_imports_without_any_broker_client() -> None:
    done = run_without(
        "aio_pika,aiormq,nats,celery,kombu",
        "import asgi_idempotency.integrations, asgi_idempotency.integrations._brokers\n"
        "try:\n"
        "    import asgi_idempotency.integrations.rabbitmq\n"
        "except ImportError as exc:\n"
        "    print('needs', exc.name or exc)\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("needs aio_pika"), done.stdout
