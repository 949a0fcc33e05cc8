#!/usr/bin/env bash
# RabbitMQ 4.x brokers for the broker test tier (tests/brokers/), beside the
# RabbitMQ on 127.0.0.1:5672, which this script never touches.
#
#   scripts/brokers.sh up [BROKER...]      build what is missing, start, wait until ready
#   scripts/brokers.sh down [BROKER...]    stop cleanly, unmount the roots no node uses
#   scripts/brokers.sh status [--env]      version and ports of each broker; --env prints
#                                          LILY_BROKERS=... for the broker tier instead
#   scripts/brokers.sh running             the names of the brokers that answer, one a line
#   scripts/brokers.sh build               only build the missing roots
#   scripts/brokers.sh reset [BROKER...]   down, then forget the brokers' data (queues, cluster)
#   scripts/brokers.sh ctl NODE ARGS...    rabbitmqctl ARGS on a node (r43, r40, c43-1, c43-2, c43-3),
#                                          e.g. ctl r43 set_policy lily-timeout '^t\.' '{"consumer-timeout": 3000}'
#   scripts/brokers.sh kill NODE           SIGKILL one node (a node loss: no clean shutdown)
#   scripts/brokers.sh start NODE          start one node again and wait until it has booted
#                                          (a cluster's node rejoins its cluster as it boots)
#
# The brokers (BROKER names), all on 127.0.0.1, user guest / guest:
#
#   name  RabbitMQ                   Debian package of   nodes (AMQP port, distribution port)
#   r43   4.3 (4.3.6, Erlang 29)     sid                 lily-r43@localhost (5743, 25743)
#   r40   4.0 (4.0.5, Erlang 27)     13 "trixie"         lily-r40@localhost (5740, 25740)
#   c43   4.3, a three-node cluster  sid                 lily-c43-1@localhost (5751, 25751)
#                                                        lily-c43-2@localhost (5752, 25752)
#                                                        lily-c43-3@localhost (5753, 25753)
#
# No plugin is enabled (no management, Prometheus or stream ports). Each node's
# command-line tools use distribution ports 10000 above the node's.
#
# Each Debian suite's rabbitmq-server package is installed once into a root made by
# `debootstrap --variant=minbase` (about 400 MB and a few minutes each, the two built
# at the same time), from the mirror apt already uses (LILY_BROKERS_MIRROR overrides
# it), in LILY_BROKERS_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/lily-mongo/brokers).
# A root counts only once its build finished and was checked; a build cut short is
# thrown away and done again. Later runs reuse the roots. Nodes run through `chroot`
# as the root's rabbitmq user, with their data and logs in the root under
# /srv/lily-brokers/<node>/, kept between runs (`reset` forgets them); they register
# with the machine's epmd. Needs root (debootstrap, mount, chroot).
set -euo pipefail

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    # The cache stays the calling user's.
    exec sudo env LILY_BROKERS_CACHE="${LILY_BROKERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lily-mongo/brokers}" \
      LILY_BROKERS_MIRROR="${LILY_BROKERS_MIRROR:-}" LILY_AMQP_URL="${LILY_AMQP_URL:-}" bash "$SCRIPT" "$@"
  fi
  echo "brokers: needs root (debootstrap, mount, chroot) and sudo is not installed" >&2
  exit 1
fi

CACHE="${LILY_BROKERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lily-mongo/brokers}"
BROKERS=(r43 r40 c43)
DATA=/srv/lily-brokers  # inside a root
# The schedulers of each node: one normal scheduler, no busy waiting (the nodes
# share a small machine with the tests); distribution on the loopback interface only.
ERL_ARGS="+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none -kernel inet_dist_use_interface {127,0,0,1}"

broker_suite() { case $1 in r43 | c43) echo sid ;; r40) echo trixie ;; esac; }
broker_nodes() { case $1 in c43) echo c43-1 c43-2 c43-3 ;; *) echo "$1" ;; esac; }
broker_label() { case $1 in r43) echo "RabbitMQ 4.3" ;; r40) echo "RabbitMQ 4.0" ;; c43) echo "RabbitMQ 4.3, three-node cluster" ;; esac; }
node_suite() { broker_suite "${1%%-*}"; }
node_name() { echo "lily-$1@localhost"; }
node_port() {
  case $1 in
    r43) echo 5743 ;; r40) echo 5740 ;; c43-1) echo 5751 ;; c43-2) echo 5752 ;; c43-3) echo 5753 ;;
  esac
}
node_dist_port() { echo $(($(node_port "$1") + 20000)); }
root_of() { echo "$CACHE/$1"; }
broker_url() { echo "amqp://guest:guest@127.0.0.1:$(node_port "$(broker_nodes "$1" | cut -d' ' -f1)")/"; }

say() { echo "brokers: $*"; }
fail() {
  echo "brokers: $*" >&2
  exit 1
}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

check_broker_names() {
  local name
  for name in "$@"; do
    [[ " ${BROKERS[*]} " == *" $name "* ]] || fail "no broker named '$name' (the brokers: ${BROKERS[*]})"
  done
}

# -- roots --------------------------------------------------------------------------------------

mirror() {
  if [[ -n ${LILY_BROKERS_MIRROR:-} ]]; then
    echo "$LILY_BROKERS_MIRROR"
    return
  fi
  # The first Debian archive apt uses (not the security one, not an extra repository):
  # the one whose suite is this machine's release.
  python3 - <<'PY'
import glob, re, sys
codename = ""
for line in open("/etc/os-release"):
    if line.startswith("VERSION_CODENAME="):
        codename = line.split("=", 1)[1].strip().strip('"')
found = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = dict(
            (k.strip().lower(), v.split())
            for k, _, v in (line.partition(":") for line in stanza.splitlines() if line and not line.startswith("#"))
        )
        if "deb" in fields.get("types", []) and codename in fields.get("suites", []):
            found += fields.get("uris", [])
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        continue
    for line in lines:
        words = [w for w in line.split("#")[0].split() if not w.startswith("[")]
        if len(words) >= 3 and words[0] == "deb" and words[2] == codename:
            found.append(words[1])
if not found:
    sys.exit(f"brokers: no Debian mirror for '{codename}' in /etc/apt/sources.list*; set LILY_BROKERS_MIRROR")
print(found[0])
PY
}

root_ok() { [[ -f $(root_of "$1")/.lily-root-ok ]]; }

# Unmount whatever is mounted at or below a directory (a build cut short may leave
# debootstrap's /proc and /sys mounts), deepest first.
unmount_below() {
  local dir mounts
  dir=$(realpath -m "$1")
  mounts=$(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
  local m
  for m in $mounts; do umount "$m" 2>/dev/null || umount -l "$m"; done
}

build_root() {
  local suite=$1 root build log started mirror_url version
  root=$(root_of "$suite")
  build="$root.build"
  log="$CACHE/$suite.build.log"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/$suite.lock"
  flock 9  # another `up` building the same root: wait for it, then reuse its result
  if root_ok "$suite"; then
    return 0
  fi
  if [[ -e $root ]]; then
    say "$suite: $root is not a finished root; building it again"
    unmount_below "$root"
    rm -rf --one-file-system "$root"
  fi
  if [[ -e $build ]]; then
    say "$suite: throwing away a build that was cut short ($build)"
    unmount_below "$build"
    rm -rf --one-file-system "$build"
  fi
  mirror_url=$(mirror)
  say "$suite: building the root from $mirror_url (log: $log)"
  started=$(now)
  if ! debootstrap --variant=minbase --include=rabbitmq-server "$suite" "$build" "$mirror_url" >"$log" 2>&1; then
    unmount_below "$build"
    tail -n 20 "$log" >&2
    fail "$suite: debootstrap failed (log: $log)"
  fi
  unmount_below "$build"
  version=$(chroot "$build" dpkg-query -W -f "\${Version}" rabbitmq-server) ||
    fail "$suite: rabbitmq-server is not installed in the root (log: $log)"
  [[ -x $build/usr/lib/rabbitmq/bin/rabbitmq-server ]] || fail "$suite: no /usr/lib/rabbitmq/bin/rabbitmq-server in the root"
  chroot "$build" getent passwd rabbitmq >/dev/null || fail "$suite: the root has no rabbitmq user"
  align_user "$build"
  printf 'rabbitmq-server %s\nerlang-base %s\nbuilt in %s s from %s\n' "$version" \
    "$(chroot "$build" dpkg-query -W -f "\${Version}" erlang-base)" "$(since "$started")" "$mirror_url" >"$build/.lily-root-ok"
  mv "$build" "$root"
  say "$suite: root built in $(since "$started") s (rabbitmq-server $version)"
}

# The root's rabbitmq user takes the uid and gid of this machine's rabbitmq user, when there is
# one, so that the nodes' processes and files belong to rabbitmq here too, not to whichever user
# of this machine happens to have the numbers the root's package chose. Only while no node of
# the root runs (and nothing is mounted in it).
align_user() {
  local root=$1 uid gid old_uid old_gid
  uid=$(id -u rabbitmq 2>/dev/null) || return 0
  gid=$(id -g rabbitmq)
  old_uid=$(chroot "$root" id -u rabbitmq)
  old_gid=$(chroot "$root" id -g rabbitmq)
  [[ $uid == "$old_uid" && $gid == "$old_gid" ]] && return 0
  if { [[ $uid != "$old_uid" ]] && chroot "$root" getent passwd "$uid" >/dev/null; } ||
    { [[ $gid != "$old_gid" ]] && chroot "$root" getent group "$gid" >/dev/null; }; then
    say "$(basename "$root"): uid $uid or gid $gid is taken in the root; its rabbitmq user keeps $old_uid:$old_gid"
    return 0
  fi
  chroot "$root" groupmod -g "$gid" rabbitmq
  chroot "$root" usermod -u "$uid" -g "$gid" rabbitmq
  find "$root" -xdev -uid "$old_uid" -exec chown -h "$uid" {} +
  find "$root" -xdev -gid "$old_gid" -exec chgrp -h "$gid" {} +
  say "$(basename "$root"): the root's rabbitmq user is now $uid:$gid, as on this machine"
}

ensure_debootstrap() {
  command -v debootstrap >/dev/null 2>&1 && return
  say "installing debootstrap with apt"
  apt-get install -y debootstrap >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y debootstrap >/dev/null; } ||
    fail "could not install debootstrap with apt"
}

# Build the roots the given brokers need that are missing, at the same time.
build_roots() {
  local suites=() suite pids=() failed=0
  for broker in "$@"; do
    suite=$(broker_suite "$broker")
    [[ " ${suites[*]} " == *" $suite "* ]] || suites+=("$suite")
  done
  local missing=()
  for suite in "${suites[@]}"; do
    if root_ok "$suite"; then
      say "$suite: reusing the root in $(root_of "$suite") ($(sed -n 1p "$(root_of "$suite")/.lily-root-ok"), $(sed -n 3p "$(root_of "$suite")/.lily-root-ok"))"
    else
      missing+=("$suite")
    fi
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  ensure_debootstrap
  for suite in "${missing[@]}"; do
    (build_root "$suite") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  [[ $failed -eq 0 ]] || fail "a root could not be built"
}

mount_root() {
  local root node broker running=0
  root=$(root_of "$1")
  # A root built before its user was aligned: align it while none of its nodes runs.
  for broker in "${BROKERS[@]}"; do
    [[ $(broker_suite "$broker") == "$1" ]] || continue
    for node in $(broker_nodes "$broker"); do node_alive "$node" && running=1; done
  done
  if [[ $running -eq 0 ]]; then
    unmount_below "$root/proc"
    unmount_below "$root/dev"
    align_user "$root"
  fi
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
  cp /etc/hosts "$root/etc/hosts"
}

# Unmount a root once none of its nodes runs.
unmount_root() {
  local suite=$1 node broker
  for broker in "${BROKERS[@]}"; do
    [[ $(broker_suite "$broker") == "$suite" ]] || continue
    for node in $(broker_nodes "$broker"); do node_alive "$node" && return 0; done
  done
  local root
  root=$(root_of "$suite")
  [[ -d $root ]] && unmount_below "$root/proc" && unmount_below "$root/dev"
  return 0
}

# -- nodes --------------------------------------------------------------------------------------

node_dir() { echo "$(root_of "$(node_suite "$1")")$DATA/$1"; }

node_pid() {
  local file
  file="$(node_dir "$1")/mnesia/$(node_name "$1").pid"
  [[ -s $file ]] && cat "$file"
}

# A process that is this node's: its environment names the node (a stale pid file may
# name a pid used by something else since; RabbitMQ 4.3's VM does not carry the node's
# name on its command line). Not `tr | grep -q`: grep leaves early, tr dies of SIGPIPE,
# and pipefail fails the pipeline although the name was found.
is_node_process() {
  [[ -n $1 && -r /proc/$1/environ ]] &&
    [[ $'\n'$({ tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null)$'\n' == *$'\n'"RABBITMQ_NODENAME=$(node_name "$2")"$'\n'* ]]
}

node_alive() {
  local pid
  pid=$(node_pid "$1") && is_node_process "$pid" "$1" && return 0
  # Booting, before the node writes its pid file: the launcher (rabbitmq-server's script).
  pid=$(cat "$(node_dir "$1")/launcher.pid" 2>/dev/null) && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null &&
    grep -q rabbitmq-server "/proc/$pid/cmdline" 2>/dev/null
}

# The command that runs a program inside a node's root as its rabbitmq user, with the
# node's environment, in the array NODE_COMMAND.
node_command() {
  local node=$1 suite root uid gid
  suite=$(node_suite "$node")
  root=$(root_of "$suite")
  uid=$(chroot "$root" id -u rabbitmq)
  gid=$(chroot "$root" id -g rabbitmq)
  NODE_COMMAND=(
    chroot --userspec="$uid:$gid" "$root" /usr/bin/env -i
    PATH=/usr/lib/rabbitmq/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 LC_ALL=C.UTF-8
    HOME="$DATA/$node/home"
    RABBITMQ_NODENAME="$(node_name "$node")"
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
    RABBITMQ_NODE_PORT="$(node_port "$node")"
    RABBITMQ_DIST_PORT="$(node_dist_port "$node")"
    RABBITMQ_MNESIA_BASE="$DATA/$node/mnesia"
    RABBITMQ_LOG_BASE="$DATA/$node/log"
    RABBITMQ_CONFIG_FILE="$DATA/$node/rabbitmq.conf"
    RABBITMQ_ENABLED_PLUGINS_FILE="$DATA/$node/enabled_plugins"
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="$ERL_ARGS"
  )
}

in_node() {
  local node=$1
  shift
  node_command "$node"
  "${NODE_COMMAND[@]}" "$@"
}

ctl() {
  local node=$1
  shift
  in_node "$node" rabbitmqctl -q -n "$(node_name "$node")" "$@"
}

prepare_node() {
  local node=$1 suite root dir uid gid
  suite=$(node_suite "$node")
  root=$(root_of "$suite")
  dir=$(node_dir "$node")
  uid=$(chroot "$root" id -u rabbitmq)
  gid=$(chroot "$root" id -g rabbitmq)
  mkdir -p "$dir/home" "$dir/mnesia" "$dir/log"
  # One Erlang cookie per root, so the nodes of the cluster (and the command-line
  # tools) can talk to each other.
  if [[ ! -s $root$DATA/.erlang.cookie ]]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$root$DATA/.erlang.cookie"
  fi
  cp "$root$DATA/.erlang.cookie" "$dir/home/.erlang.cookie"
  chmod 400 "$dir/home/.erlang.cookie"
  cat >"$dir/rabbitmq.conf" <<EOF
# Written by scripts/brokers.sh. guest may log in over the loopback interface only
# (RabbitMQ's default, stated here).
loopback_users.guest = true
log.console = false
log.file.level = info
EOF
  [[ -f $dir/enabled_plugins ]] || echo '[].' >"$dir/enabled_plugins"
  chown -R "$uid:$gid" "$dir"
}

# Whether something listens on a port (connections in TIME_WAIT do not count: the nodes
# bind with SO_REUSEADDR too).
port_taken() {
  python3 - "$1" <<'PY'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
}

# Start a node's process (not waiting for it); nothing if it runs already.
launch_node() {
  local node=$1 dir port
  node_alive "$node" && return 0
  port=$(node_port "$node")
  port_taken "$port" && fail "$node: port $port is taken by another program"
  port_taken "$(node_dist_port "$node")" && fail "$node: port $(node_dist_port "$node") is taken by another program"
  prepare_node "$node"
  dir=$(node_dir "$node")
  rm -f "$dir/mnesia/$(node_name "$node").pid"
  node_command "$node"
  # The node must not hold this script's lock files open (fds 8 and 9) for as long as it runs.
  setsid "${NODE_COMMAND[@]}" rabbitmq-server >>"$dir/log/console.log" 2>&1 </dev/null 8>&- 9>&- &
  echo $! >"$dir/launcher.pid"
  return 0
}

# Wait until a launched node has booted (rabbitmqctl await_startup), failing early if its
# process ends. await_startup fails at once while the node has not registered with epmd
# yet, so it is tried again as long as the node's process runs.
await_node() {
  local node=$1 dir deadline=$((SECONDS + 180))
  dir=$(node_dir "$node")
  until ctl "$node" await_startup --timeout 180 >"$dir/log/await.log" 2>&1; do
    if ! node_alive "$node" || ((SECONDS > deadline)); then
      echo "--- $dir/log/console.log (last lines)" >&2
      tail -n 30 "$dir/log/console.log" >&2 || true
      tail -n 5 "$dir/log/await.log" >&2 || true
      fail "$node: did not start (logs: $dir/log)"
    fi
    sleep 1
  done
}

stop_node() {
  local node=$1 pid
  node_alive "$node" || return 0
  pid=$(node_pid "$node") || pid=$(cat "$(node_dir "$node")/launcher.pid")
  if ! ctl "$node" shutdown --timeout 60 >/dev/null 2>&1; then
    say "$node: rabbitmqctl shutdown failed; sending SIGTERM to $pid"
    kill -TERM "$pid" 2>/dev/null || true
  fi
  local _
  for _ in $(seq 1 120); do
    node_alive "$node" || return 0
    sleep 0.5
  done
  fail "$node: process $pid still runs 60 s after the stop"
}

# SIGKILL one node's Erlang VM, as a machine that dies would, and wait until its port is closed.
kill_node() {
  local node=$1 pid
  pid=$(node_pid "$node") && is_node_process "$pid" "$node" || fail "kill: $node is not running"
  kill -KILL "$pid"
  local _
  for _ in $(seq 1 100); do
    if ! is_node_process "$pid" "$node" && ! amqp_version "$(node_port "$node")" >/dev/null; then
      say "$node: killed (pid $pid, SIGKILL)"
      return 0
    fi
    sleep 0.1
  done
  fail "$node: pid $pid still runs 10 s after SIGKILL"
}

# Start one node again (its broker's root mounted) and wait until it has booted.
start_node() {
  local node=$1 started
  started=$(now)
  if node_alive "$node"; then
    say "$node: already running"
    return 0
  fi
  mount_root "$(node_suite "$node")"
  launch_node "$node"
  await_node "$node"
  say "$node: started in $(since "$started") s"
}

# -- the cluster --------------------------------------------------------------------------------

cluster_members() {
  ctl c43-1 cluster_status --formatter json | python3 -c '
import json, sys
status = json.load(sys.stdin)
print(" ".join(sorted(status.get("running_nodes", []))))'
}

form_cluster() {
  local started node members wanted
  wanted="$(node_name c43-1) $(node_name c43-2) $(node_name c43-3)"
  members=$(cluster_members)
  [[ $members == "$wanted" ]] && return 0
  started=$(now)
  for node in c43-2 c43-3; do
    [[ " $members " == *" $(node_name "$node") "* ]] && continue
    ctl "$node" stop_app
    ctl "$node" reset
    ctl "$node" join_cluster "$(node_name c43-1)"
    ctl "$node" start_app
    ctl "$node" await_startup --timeout 120
  done
  members=$(cluster_members)
  [[ $members == "$wanted" ]] || fail "c43: the cluster's running nodes are '$members', not '$wanted'"
  say "c43: cluster of three nodes formed in $(since "$started") s"
}

# -- commands -----------------------------------------------------------------------------------

# Start one broker's nodes (those not running), wait until each has booted, form the
# cluster; print how long it took.
start_broker() {
  local broker=$1 node started launched=0
  started=$(now)
  for node in $(broker_nodes "$broker"); do
    node_alive "$node" && continue
    launch_node "$node"
    launched=1
  done
  # All the nodes of a cluster are launched before waiting for any: nodes that ran
  # together before wait for each other while booting.
  for node in $(broker_nodes "$broker"); do await_node "$node"; done
  [[ $broker == c43 ]] && form_cluster
  if [[ $launched -eq 1 ]]; then
    say "$broker: started in $(since "$started") s"
  else
    say "$broker: already running"
  fi
}

up() {
  local brokers=("$@") broker pids=() failed=0 started
  [[ ${#brokers[@]} -eq 0 ]] && brokers=("${BROKERS[@]}")
  started=$(now)
  build_roots "${brokers[@]}"
  for broker in "${brokers[@]}"; do mount_root "$(broker_suite "$broker")"; done
  for broker in "${brokers[@]}"; do
    (start_broker "$broker") &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  [[ $failed -eq 0 ]] || fail "a broker did not start (see above)"
  say "up: ${brokers[*]} (in $(since "$started") s)"
}

down() {
  local brokers=("$@") broker node pids=() suites=()
  [[ ${#brokers[@]} -eq 0 ]] && brokers=("${BROKERS[@]}")
  for broker in "${brokers[@]}"; do
    for node in $(broker_nodes "$broker"); do
      (stop_node "$node") &
      pids+=($!)
    done
  done
  local failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  for broker in "${BROKERS[@]}"; do
    local suite
    suite=$(broker_suite "$broker")
    [[ " ${suites[*]} " == *" $suite "* ]] || suites+=("$suite")
  done
  for suite in "${suites[@]}"; do unmount_root "$suite"; done
  [[ $failed -eq 0 ]] || fail "a node did not stop"
  say "stopped: ${brokers[*]}"
}

reset() {
  local brokers=("$@") broker node
  [[ ${#brokers[@]} -eq 0 ]] && brokers=("${BROKERS[@]}")
  down "${brokers[@]}"
  for broker in "${brokers[@]}"; do
    for node in $(broker_nodes "$broker"); do rm -rf --one-file-system "$(node_dir "$node")"; done
  done
  say "forgot the data of: ${brokers[*]}"
}

# The version a node reports in its AMQP connection.start (and whether it answers at all).
amqp_version() {
  python3 - "$1" <<'PY'
import socket, struct, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    data = b""
    while len(data) < 7 or len(data) < 8 + struct.unpack(">I", data[3:7])[0]:
        chunk = s.recv(65536)
        if not chunk:
            raise OSError("closed")
        data += chunk
    s.close()
except OSError:
    sys.exit(1)
# connection.start: class, method, version major/minor, then the server-properties table
table = data[7 + 6:]
size = struct.unpack(">I", table[:4])[0]
table, i = table[4 : 4 + size], 0
props = {}
while i < len(table):
    n = table[i]; key = table[i + 1 : i + 1 + n].decode(); i += 1 + n
    kind = chr(table[i]); i += 1
    if kind == "S":
        length = struct.unpack(">I", table[i : i + 4])[0]
        props[key] = table[i + 4 : i + 4 + length].decode(errors="replace"); i += 4 + length
    elif kind == "F":
        length = struct.unpack(">I", table[i : i + 4])[0]; i += 4 + length
    else:
        break  # the fields of interest come before any other kind in RabbitMQ's table
print(props.get("version", "?"))
PY
}

status() {
  if [[ ${1:-} == --env ]]; then
    local entries=("system=${LILY_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}") broker
    for broker in "${BROKERS[@]}"; do entries+=("$broker=$(broker_url "$broker")"); done
    (IFS=,; echo "LILY_BROKERS=${entries[*]}")
    return 0
  fi
  local broker node all_up=0 version
  printf '%-5s %-34s %-28s %-6s %-6s %s\n' broker what node amqp dist state
  for broker in "${BROKERS[@]}"; do
    for node in $(broker_nodes "$broker"); do
      if version=$(amqp_version "$(node_port "$node")"); then
        version="up, RabbitMQ $version (pid $(node_pid "$node" || echo ?))"
      else
        version="down"
        all_up=1
      fi
      printf '%-5s %-34s %-28s %-6s %-6s %s\n' "$broker" "$(broker_label "$broker")" "$(node_name "$node")" \
        "$(node_port "$node")" "$(node_dist_port "$node")" "$version"
    done
  done
  local suite
  for suite in sid trixie; do
    if root_ok "$suite"; then
      echo "root $suite: $(root_of "$suite") ($(head -n 3 "$(root_of "$suite")/.lily-root-ok" | paste -sd ';' | sed 's/;/; /g'))"
    else
      echo "root $suite: not built ($(root_of "$suite"))"
    fi
  done
  if amqp_version "$(node_port c43-1)" >/dev/null; then
    echo "cluster c43 running nodes: $(cluster_members 2>/dev/null || echo '?')"
  fi
  return $all_up
}

running() {
  local broker node alive
  for broker in "${BROKERS[@]}"; do
    alive=1
    for node in $(broker_nodes "$broker"); do amqp_version "$(node_port "$node")" >/dev/null || alive=0; done
    [[ $alive -eq 1 ]] && echo "$broker"
  done
  return 0
}

# One `up`, `down` or `reset` at a time on a machine.
serialize() {
  mkdir -p "$CACHE"
  exec 8>"$CACHE/.brokers.lock"
  flock 8
}

command=${1:-}
[[ $# -gt 0 ]] && shift
case $command in
  up | down | reset | start) serialize ;;
esac
case $command in
  up) check_broker_names "$@" && up "$@" ;;
  down) check_broker_names "$@" && down "$@" ;;
  reset) check_broker_names "$@" && reset "$@" ;;
  status) status "$@" ;;
  running) running ;;
  build) build_roots "${BROKERS[@]}" ;;
  kill | start)
    [[ $# -eq 1 && -n $(node_port "$1") ]] || fail "$command: name one node (r43, r40, c43-1, c43-2, c43-3)"
    if [[ $command == kill ]]; then kill_node "$1"; else start_node "$1"; fi
    ;;
  ctl)
    [[ $# -ge 1 && -n $(node_port "$1") ]] || fail "ctl: name a node (r43, r40, c43-1, c43-2, c43-3)"
    node=$1
    shift
    node_alive "$node" || fail "ctl: $node is not running (scripts/brokers.sh up)"
    in_node "$node" rabbitmqctl -n "$(node_name "$node")" "$@"
    ;;
  *)
    sed -n '2,16p' "$SCRIPT" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
