#!/bin/bash
# Starts a KRaft Kafka node configured the way the official apache/kafka image is:
#   every KAFKA_<NAME> environment variable becomes the server property <name>, lower-cased,
#   '___' -> '-', '__' -> '_', '_' -> '.'   (KAFKA_NODE_ID=1 -> node.id=1).
# JVM/tooling variables (KAFKA_HEAP_OPTS, KAFKA_OPTS, KAFKA_VERSION, KAFKA_HOME, KAFKA_LOG4J_*, ...)
# are not properties. With no KAFKA_* property variables at all, a single-node combined
# broker+controller on localhost:9092 is configured (like the official image's defaults).
# CLUSTER_ID (default below, same as the official image's) formats the storage on first start.
# KAFKA_ADD_SCRAM: SCRAM users made when the storage is formatted (KRaft keeps them in its metadata), space-separated
# entries of the StorageTool's --add-scram form, 'SCRAM-SHA-512=[name=alice,password=alice-secret]' (no spaces).
set -euo pipefail

KAFKA_HOME=${KAFKA_HOME:-/opt/kafka}
CONF=${KAFKA_CONFIG_FILE:-/opt/kafka/config/server.properties}
CLUSTER_ID=${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}

is_jvm_var() {
  case "$1" in
    KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_JMX_OPTS|KAFKA_JMX_PORT|\
    KAFKA_LOG4J_OPTS|KAFKA_LOG4J_ROOT_LOGLEVEL|KAFKA_LOG4J_LOGGERS|KAFKA_TOOLS_LOG4J_LOGLEVEL|\
    KAFKA_VERSION|KAFKA_HOME|KAFKA_CONFIG_FILE|KAFKA_DEBUG|KAFKA_SKIP_FORMAT|KAFKA_ADD_SCRAM) return 0 ;;
  esac
  return 1
}

props=""
while IFS='=' read -r name value; do
  [[ $name == KAFKA_* ]] || continue
  is_jvm_var "$name" && continue
  key=${name#KAFKA_}
  key=$(printf '%s' "$key" | tr '[:upper:]' '[:lower:]' | sed -e 's/___/-/g' -e 's/__/@US@/g' -e 's/_/./g' -e 's/@US@/_/g')
  props+="$key=${!name}"$'\n'
done < <(env | grep -E '^KAFKA_[A-Z0-9_]+=' || true)

if [[ -z $props ]]; then
  props="node.id=1
process.roles=broker,controller
listeners=PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
controller.quorum.voters=1@localhost:9093
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
"
fi
if ! grep -qE '^log\.dirs?=' <<<"$props"; then
  props+="log.dirs=/var/lib/kafka/data"$'\n'
fi
printf '%s' "$props" > "$CONF"
echo "[entrypoint] Apache Kafka ${KAFKA_VERSION:-?} server.properties:"
sed 's/^\(.*password.*=\).*/\1*****/I' "$CONF"

CP="$KAFKA_HOME/libs/*"
LOG4J="-Dlog4j2.configurationFile=$KAFKA_HOME/config/log4j2.xml"

if [[ -z ${KAFKA_SKIP_FORMAT:-} ]]; then
  fmt=(format --ignore-formatted --cluster-id="$CLUSTER_ID" -c "$CONF")
  # Without a static voter set (controller.quorum.voters), a single node bootstraps a dynamic quorum.
  grep -q '^controller\.quorum\.voters=' "$CONF" || fmt+=(--standalone)
  read -ra scram <<<"${KAFKA_ADD_SCRAM:-}"
  for entry in "${scram[@]}"; do fmt+=(--add-scram "$entry"); done
  java $LOG4J -cp "$CP" kafka.tools.StorageTool "${fmt[@]}"
fi

exec java ${KAFKA_HEAP_OPTS:--Xmx1G -Xms256m} ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true} \
  ${KAFKA_OPTS:-} $LOG4J -cp "$CP" kafka.Kafka "$CONF"
