#!/usr/bin/env bash
# The main job: the example orders service on the embedded MongoDB-wire server
# (or LILY_MONGO_URI) and the local RabbitMQ (or LILY_AMQP_URL).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
uv_run lily-mongo demo "$@"
