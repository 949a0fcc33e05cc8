#!/usr/bin/env bash
# The whole test suite (unit, property, integration). Integration tests use the
# RabbitMQ at LILY_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) and the
# MongoDB at LILY_MONGO_URI (default: an embedded MongoDB-wire server they start).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
uv_run pytest "$@"
