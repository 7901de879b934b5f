"""``packrat-mq submit``: send one request and print its reply."""
from __future__ import annotations

import json
from pathlib import Path

import click

from packrat_mq import protocol
from packrat_mq.cli.helpers import connect_or_fail, echo_json, redis_options
from packrat_mq.client import Client, ReplyTimeout
from packrat_mq.settings import Settings


#: Content types by file extension, for files whose first bytes do not say.
EXTENSIONS = {".json": protocol.JSON, ".txt": protocol.TEXT, ".npy": protocol.NPY, ".jpg": protocol.JPEG,
              ".jpeg": protocol.JPEG, ".png": protocol.PNG, ".webp": protocol.WEBP}


def file_content_type(path: Path, payload: bytes) -> str:
    """The content type of a file: from its first bytes, else its extension, else raw bytes."""
    return protocol.sniff_content_type(payload) or EXTENSIONS.get(path.suffix.lower(), protocol.BYTES)


@click.command()
@click.option("--model", "-m", required=True, help="Model to send to.")
@click.option("--data", "-d", "data", default=None, help="JSON payload (default content type).")
@click.option("--text", default=None, help="Plain-text payload (text/plain).")
@click.option("--file", "file", type=click.Path(path_type=Path), default=None,
              help="Payload from a file, its content type read from its first bytes (JPEG, PNG, WebP, .npy), "
                   "else from its extension (.json, .txt), else application/octet-stream.")
@click.option("--content-type", default=None, help="Override the content type.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the reply.")
@click.option("--deadline", type=float, default=None, help="Ask the service to give up after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole reply as one JSON object.")
@click.option("--shm", is_flag=True,
              help="Put the payload in shared memory (a file in PACKRAT_SHM_DIR that the request names) instead "
                   "of Redis; only on the host that serves the model.")
@click.option("--sealed", is_flag=True,
              help="Put the payload in a sealed memfd that the workers map (payload_fd) instead of Redis; only "
                   "on the serving host, as the workers' user, in their PID namespace (not from another container).")
@redis_options
def submit(
    settings: Settings,
    model: str,
    data: str | None,
    text: str | None,
    file: Path | None,
    content_type: str | None,
    timeout: float,
    deadline: float | None,
    as_json: bool,
    shm: bool,
    sealed: bool,
) -> None:
    """Send one request to MODEL and print the reply.

    \b
    Examples:
      packrat-mq submit -m echo -d '{"hello": "world"}'
      packrat-mq submit -m minilm --text "A man is eating food." --json
      packrat-mq submit -m resnet50 --file photo.jpg
      packrat-mq submit -m resnet50 --file image.npy --shm   # on the serving host: not through Redis
      packrat-mq submit -m resnet50 --file image.npy --sealed   # ...and mapped by the worker, not read
    """
    given = [x is not None for x in (data, text, file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --data, --text, --file")
    if data is not None:
        payload, ctype = data.encode(), protocol.JSON
        try:
            json.loads(data)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--data") from None
    elif text is not None:
        payload, ctype = text.encode(), protocol.TEXT
    else:
        assert file is not None
        try:
            payload = file.read_bytes()
        except OSError as exc:
            raise click.ClickException(f"cannot read --file {str(file)!r}: {exc.strerror or exc}") from None
        ctype = file_content_type(file, payload)
    r, _ = connect_or_fail(settings)
    if not r.sismember(settings.keys.models(), model):
        served = ", ".join(sorted(m.decode() for m in r.smembers(settings.keys.models()))) or "none"
        raise click.ClickException(f"model {model!r} is not served here (served: {served}); "
                                   f"start it with `packrat-mq up --model {model}`")
    client = Client(r, prefix=settings.prefix, shared_memory="sealed" if sealed else shm, shm_dir=settings.shm_dir,
                    shm_min_bytes=1)
    try:
        reply = client.submit(model, payload, content_type=content_type or ctype, timeout=timeout, deadline_s=deadline)
    except ReplyTimeout as exc:
        raise click.ClickException(f"{exc}; is `packrat-mq up --model {model}` running?") from None
    finally:
        client.close()
    value = None
    if reply.ok:
        value = reply.value()
        if hasattr(value, "tolist"):
            value = value.tolist()
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
    if as_json:
        echo_json({
            "id": reply.id, "status": reply.status, "error": reply.error or None, "value": value,
            "content_type": reply.content_type, "queue_ms": reply.queue_ms,
            "inference_ms": reply.inference_ms, "latency_ms": reply.latency_ms,
            "instance": reply.fields.get("instance"), "batch_size": reply.fields.get("batch_size"),
        })
    else:
        if reply.ok:
            click.echo(json.dumps(value) if not isinstance(value, str) else value)
        else:
            click.echo(f"error: {reply.error}", err=True)
        click.echo(f"[{reply.status}] latency {reply.latency_ms:.2f} ms (queue {reply.queue_ms:.2f} ms, "
                   f"inference {reply.inference_ms:.2f} ms, instance {reply.fields.get('instance', '-')})", err=True)
    if not reply.ok:
        raise SystemExit(1)
