{{/*
lastcall's alert rules, as Prometheus rule groups. Rendered into the PrometheusRule and, by
hack/render-manifests.py, into manifests/prometheus-rules.yaml, which promtool checks and
unit-tests (hack/promtool/alerts-test.yaml). Only metrics the binaries export may appear
here: tests/tests/packaging.rs compares them with a real scrape.
*/}}
{{- define "lastcall.alertGroups" -}}
{{- $r := .Values.metrics.prometheusRule -}}
groups:
  - name: lastcall-agent
    rules:
      - alert: LastcallDrainTooLong
        expr: max by (namespace, pod, node) (lastcall_drain_phase{phase=~"fencing|draining|cancelling"}) == 1
        for: {{ $r.drainTooLongMinutes }}m
        labels:
          severity: warning
        annotations:
          summary: "Node {{`{{ $labels.node }}`}} has been draining for more than {{ $r.drainTooLongMinutes }} minutes."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} has not finished the drain: matches are still running or a write keeps failing. See docs/operations.md, \"A drain is stuck\"."
      - alert: LastcallEmptyNodeStillRegistered
        # `empty` is the end of a drain without FleetIQ; with FleetIQ the agent deregisters
        # within seconds of reaching it, so a FleetIQ agent that stays `empty` cannot
        # deregister (IAM without gamelift:DescribeGameServer or DeregisterGameServer,
        # GameLift unreachable) and FleetIQ keeps counting the instance.
        expr: |-
          (max by (namespace, pod, node) (lastcall_drain_phase{phase="empty"}) == 1)
          and on (namespace, pod) lastcall_source_up{source="fleetiq"}
        for: {{ $r.emptyRegisteredMinutes }}m
        labels:
          severity: warning
        annotations:
          summary: "Node {{`{{ $labels.node }}`}} has been empty for {{ $r.emptyRegisteredMinutes }} minutes but is still registered with FleetIQ."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} cannot deregister the instance: check lastcall_gamelift_calls_total{operation=~\"DescribeGameServer|DeregisterGameServer\"} and the agent's IAM policy. See docs/operations.md, \"A node stays empty but registered\"."
      - alert: LastcallSourceDown
        # IMDS or the GCE metadata server unreachable (on GKE under Workload Identity without
        # hostNetwork it never answers): the node drains on its other signals only.
        expr: max by (namespace, pod, node, source) (lastcall_source_up{source!="fleetiq"}) == 0
        for: {{ $r.sourceDownMinutes }}m
        labels:
          severity: warning
        annotations:
          summary: "Signal source {{`{{ $labels.source }}`}} is down on node {{`{{ $labels.node }}`}}."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} has not read {{`{{ $labels.source }}`}} for {{ $r.sourceDownMinutes }} minutes; notices from it are missed. See docs/operations.md, \"A signal source is down\"."
      - alert: LastcallLifecycleHeartbeatDenied
        # The Auto Scaling API refused RecordLifecycleActionHeartbeat (AccessDenied): the
        # instance the agent holds goes at the hook's heartbeat timeout, matches or not. The
        # gauge is 1 only while such a wait is held, so there is nothing to wait for.
        expr: max by (namespace, pod, node) (lastcall_asg_heartbeat_denied) == 1
        labels:
          severity: critical
        annotations:
          summary: "Auto Scaling refuses lifecycle heartbeats for node {{`{{ $labels.node }}`}}: it goes at the hook's timeout."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} cannot keep its instance in Terminating:Wait: the node's IAM role lacks autoscaling:RecordLifecycleActionHeartbeat, so matches still running at the heartbeat timeout are cut off (see the LifecycleHeartbeatDenied Event on the Node). See docs/operations.md, \"Auto Scaling refuses lifecycle heartbeats\"."
      - alert: LastcallAgentMissing
        # A node the agent DaemonSet selects has no available agent (kube-state-metrics'
        # DaemonSet figures): an agent that stays Pending on a packed node (the chart's
        # PriorityClass never preempts a pod, which there could be a match), crash-loops or
        # cannot pull its image. That node's drains go unheard.
        expr: |-
          max by (namespace, daemonset) (
            kube_daemonset_status_desired_number_scheduled{daemonset="{{ include "lastcall.fullname" . }}-agent"}
            - kube_daemonset_status_number_available{daemonset="{{ include "lastcall.fullname" . }}-agent"}
          ) > 0
        for: {{ $r.agentMissingMinutes }}m
        labels:
          severity: critical
        annotations:
          summary: "{{`{{ $value }}`}} game node(s) have no running lastcall agent."
          description: "DaemonSet {{`{{ $labels.namespace }}/{{ $labels.daemonset }}`}} has had nodes without an available agent for {{ $r.agentMissingMinutes }} minutes: a doomed node among them drains without lastcall, its matches unprotected. See docs/operations.md, \"A game node has no agent\"."
      - alert: LastcallAgentPending
        # An agent pod the scheduler has not placed, or whose image does not come
        # (kube-state-metrics' pod figures; phase Pending covers both). The DaemonSet
        # controller counts it against the rollout's maxSurge (its node keeps the old agent)
        # or maxUnavailable (its node has none), so enough of them stop the rollout. The
        # chart's PriorityClass never preempts: on a packed node the agent waits for room.
        expr: |-
          max by (namespace, pod) (kube_pod_status_phase{phase="Pending"} == 1)
          and on (namespace, pod)
          kube_pod_owner{owner_kind="DaemonSet", owner_name="{{ include "lastcall.fullname" . }}-agent"}
        for: {{ $r.agentPendingMinutes }}m
        labels:
          severity: warning
        annotations:
          summary: "Agent pod {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} has been Pending for {{ $r.agentPendingMinutes }} minutes."
          description: "The agent has no room on its node (the chart's PriorityClass never preempts a pod, which there could be a match) or cannot pull its image; a rollout counts it until it runs. See docs/operations.md, \"A game node has no agent\"."
      - alert: LastcallNodeRestrictionUnenforceable
        # Start-up found that the chart's node restriction cannot hold the agent: its token
        # carries no node (not bound to a pod, Kubernetes before 1.30) or the API server serves
        # no ValidatingAdmissionPolicy v1. Such an agent can write every node's objects.
        expr: max by (namespace, pod, node) (lastcall_node_restriction_enforceable) == 0
        labels:
          severity: warning
        annotations:
          summary: "The agent on node {{`{{ $labels.node }}`}} is not held to its own node's objects."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} may write every node's Nodes, Pods and GameServers: see the NodeRestrictionUnenforceable Event on its Node for why. See docs/operations.md, \"An agent is not held to its node\"."
      - alert: LastcallDeregisteredWhileBusy
        # GameLift no longer lists the node's game server while matches run on it (it drops
        # a server whose heartbeats stopped, or an old agent deregistered on exit). lastcall
        # keeps the node fenced and hands it over only once empty; FleetIQ may meanwhile
        # count the instance as gone.
        expr: max by (namespace, pod, node) (lastcall_fleetiq_deregistered_while_busy) == 1
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "GameLift dropped the game server of busy node {{`{{ $labels.node }}`}}."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} finds its node's game server no longer registered while matches still run there (Warning Event DeregisteredWhileBusy). The node stays fenced and is handed over only when empty. See docs/operations.md, \"GameLift dropped a busy node\"."
      - alert: LastcallMachineReturnedHeld
        # A machine that came back (a new boot id) stays fenced because a source that asked
        # for its last life's drain has not reported since (down, unreachable, or removed
        # from the agent's flags): it would hold the node for good.
        expr: max by (namespace, pod, node) (lastcall_machine_returned_held) == 1
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "Node {{`{{ $labels.node }}`}} came back but stays fenced: a source of its last drain has not reported."
          description: "The agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} holds the fence of a machine that came back until every source that asked for its last drain reports again (Warning Event MachineReturnedHeld names it). Bring the source back, or end the drain by hand. See docs/operations.md, \"A machine came back\"."
      - alert: LastcallGameLiftErrors
        # `error` is every GameLift failure that is not a conflict, NotFound, throttling or a
        # network failure: AccessDenied above all.
        expr: sum by (namespace, pod, node, operation) (increase(lastcall_gamelift_calls_total{result="error"}[10m])) >= 3
        labels:
          severity: warning
        annotations:
          summary: "GameLift {{`{{ $labels.operation }}`}} fails on node {{`{{ $labels.node }}`}}."
          description: "{{`{{ $value }}`}} {{`{{ $labels.operation }}`}} calls failed in 10 minutes, usually AccessDenied: compare the agent's IAM policy with docs/install.md. See docs/operations.md, \"GameLift refuses the agent's calls\"."
      - alert: LastcallMatchesAtRisk
        expr: |-
          (sum by (namespace, pod, node) (lastcall_game_servers{state=~"allocated|reserved|unknown"}) > 0)
          and on (namespace, pod)
          (max by (namespace, pod) (lastcall_drain_phase{phase=~"fencing|draining"}) == 1)
        for: {{ $r.matchesAtRiskMinutes }}m
        labels:
          severity: warning
        annotations:
          summary: "{{`{{ $value }}`}} matches are still running on draining node {{`{{ $labels.node }}`}}."
          description: "In-use game servers have stayed on a draining node for {{ $r.matchesAtRiskMinutes }} minutes; the node may be taken before they end. Check their drain-deadline annotation (docs/operations.md)."
      - alert: LastcallMatchEvictable
        expr: max by (namespace, pod, node) (lastcall_cooperation_exposed_matches) > 0
        for: 2m
        labels:
          severity: warning
        annotations:
          summary: "{{`{{ $value }}`}} running matches on node {{`{{ $labels.node }}`}} can be taken by an autoscaler."
          description: "Autoscaler cooperation is on, but in-use game servers' pods still carry safe-to-evict=true or lack karpenter.sh/do-not-disrupt: something reverts lastcall's writes (see lastcall_writes_reverted_total and WriteReverted Events) or they keep failing. See docs/autoscalers.md."
      - alert: LastcallRedisDisconnected
        expr: (lastcall_redis_connected == 0) and on (namespace, pod) lastcall_source_up{source="fleetiq"}
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "Agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} is not subscribed to Redis."
          description: "FleetIQ statuses reach this node only through the GameLift fallback check while Redis is unreachable."
      - alert: LastcallHeartbeatFailures
        expr: sum by (namespace, pod, node) (increase(lastcall_heartbeats_total{result!~"ok|dry_run"}[10m])) >= 3
        labels:
          severity: warning
        annotations:
          summary: "FleetIQ heartbeats fail on node {{`{{ $labels.node }}`}}."
          description: "{{`{{ $value }}`}} HEALTHY heartbeats failed in 10 minutes. FleetIQ marks an instance unhealthy when heartbeats stop; check the agent's credentials and GameLift errors (lastcall_gamelift_calls_total)."
      - alert: LastcallSignalsRejected
        expr: sum by (namespace, pod, node, source, reason) (increase(lastcall_signals_rejected_total[15m])) > 0
        labels:
          severity: info
        annotations:
          summary: "Agent {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} rejected {{`{{ $labels.source }}`}} signals ({{`{{ $labels.reason }}`}})."
          description: "Malformed or foreign status messages change nothing but point at a misconfigured publisher or channel."
  - name: lastcall-pubsub
    rules:
      - alert: LastcallPubsubStale
        expr: time() - max by (namespace, pod) (lastcall_pubsub_last_successful_cycle_timestamp_seconds) > {{ mul $r.pubsubStaleMinutes 60 }}
        labels:
          severity: warning
        annotations:
          summary: "pubsub {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} has had no clean cycle for {{ $r.pubsubStaleMinutes }} minutes."
          description: "Agents keep their last status and fall back to asking GameLift themselves, one call per node."
      - alert: LastcallPubsubRedisDown
        expr: lastcall_pubsub_redis_up == 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "pubsub {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} cannot reach Redis."
          description: "No FleetIQ status is published while Redis is down."
      - alert: LastcallPubsubNoticeDropped
        expr: sum by (namespace, pod, status) (increase(lastcall_pubsub_notices_dropped_total[10m])) > 0
        labels:
          severity: warning
        annotations:
          summary: "pubsub {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} dropped {{`{{ $labels.status }}`}} notices."
          description: "Redis held a status another pubsub replica polled later, so this replica's notice was neither cached nor published. Expected only while two replicas overlap; if it repeats, check the replicas' clocks (NTP) and the warning log naming the instance."
      - alert: LastcallPubsubGroupErrors
        expr: sum by (namespace, pod, group, reason) (increase(lastcall_pubsub_group_errors_total[10m])) > 0
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "pubsub cannot poll game server group {{`{{ $labels.group }}`}} ({{`{{ $labels.reason }}`}})."
          description: "Instances of this group get no status update; check IAM (gamelift:DescribeGameServerInstances) and the group name."
      - alert: LastcallWebhookFleetHeld
        expr: max by (fleet_namespace, fleet) (lastcall_pubsub_webhook_fleet_held_seconds) > {{ mul $r.webhookFleetHeldMinutes 60 }}
        labels:
          severity: warning
        annotations:
          summary: "The FleetAutoscaler webhook has held Fleet {{`{{ $labels.fleet_namespace }}/{{ $labels.fleet }}`}} for more than {{ $r.webhookFleetHeldMinutes }} minutes."
          description: "While held the Fleet can grow but not shrink: Redis is unreadable, or a draining node's agent stopped refreshing its drain state. See docs/webhook.md, \"When the webhook does not know\"."
      - alert: LastcallWebhookBadFleetSettings
        expr: sum by (namespace, pod, source) (increase(lastcall_pubsub_webhook_bad_overrides_total[10m])) > 0
        labels:
          severity: warning
        annotations:
          summary: "A Fleet's lastcall.dev/autoscaler-* settings are invalid ({{`{{ $labels.source }}`}}) and ignored."
          description: "The webhook answers that Fleet with the flags' buffer, min and max; the warning log names the Fleet and the setting."
      - alert: LastcallQueueBackingUp
        expr: max by (namespace, pod) (lastcall_pubsub_queue_oldest_message_age_seconds) > 60
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "pubsub {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} reads interruption events that waited over a minute in the queue."
          description: "A Spot warning relayed two minutes late is no warning. pubsub is too slow or its calls fail: see lastcall_pubsub_queue_errors_total (ReceiveMessage, DeleteMessage, PatchNode), more receivers (queue.receivers), and docs/queue.md."
{{- end -}}
