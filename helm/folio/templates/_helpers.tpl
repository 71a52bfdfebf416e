{{/*
The RayService's name: KubeRay derives its services from it (<name>-serve-svc, <name>-head-svc) and appends
suffixes to its RayCluster's and pods' names, so it is kept short.
*/}}
{{- define "folio.name" -}}
{{- default .Release.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "folio.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "folio.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Generator replicas at most: the fixed count, or the autoscaling maximum. */}}
{{- define "folio.generatorMaxReplicas" -}}
{{- if .Values.generator.autoscaling.enabled -}}
{{- .Values.generator.autoscaling.maxReplicas -}}
{{- else -}}
{{- .Values.generator.replicas -}}
{{- end -}}
{{- end -}}

{{/*
Checks across values that values.schema.json cannot express; a failure stops `helm install` / `helm template`.
*/}}
{{- define "folio.validate" -}}
{{- $gen := .Values.generator -}}
{{- $auto := $gen.autoscaling -}}
{{- $workers := .Values.workers -}}
{{- if and .Values.model.draftPath .Values.model.ngram -}}
{{- fail "model.draftPath and model.ngram exclude each other: choose one drafter" -}}
{{- end -}}
{{- if and $auto.enabled (gt (int $auto.minReplicas) (int $auto.maxReplicas)) -}}
{{- fail (printf "generator.autoscaling: minReplicas (%v) exceeds maxReplicas (%v)" $auto.minReplicas $auto.maxReplicas) -}}
{{- end -}}
{{- if and $auto.enabled (ne $auto.initialReplicas nil) -}}
{{- if or (lt (int $auto.initialReplicas) (int $auto.minReplicas)) (gt (int $auto.initialReplicas) (int $auto.maxReplicas)) -}}
{{- fail (printf "generator.autoscaling.initialReplicas (%v) must lie in [minReplicas, maxReplicas]" $auto.initialReplicas) -}}
{{- end -}}
{{- end -}}
{{- if or (gt (int $workers.minReplicas) (int $workers.replicas)) (gt (int $workers.replicas) (int $workers.maxReplicas)) -}}
{{- fail (printf "workers: need minReplicas <= replicas <= maxReplicas, got %v <= %v <= %v" $workers.minReplicas $workers.replicas $workers.maxReplicas) -}}
{{- end -}}
{{- if and (gt (float64 $gen.gpusPerReplica) 1.0) (ne (float64 $gen.gpusPerReplica) (float64 (int $gen.gpusPerReplica))) -}}
{{- fail (printf "generator.gpusPerReplica: above 1 it must be a whole number, got %v" $gen.gpusPerReplica) -}}
{{- end -}}
{{- $tp := int (default 1 $gen.tensorParallelSize) -}}
{{- if and (gt $tp 1) (ne (float64 $gen.gpusPerReplica) (float64 $tp)) -}}
{{- fail (printf "generator.tensorParallelSize %v takes one GPU a rank: set generator.gpusPerReplica %v (got %v)" $tp $tp $gen.gpusPerReplica) -}}
{{- end -}}
{{- if gt (float64 $gen.gpusPerReplica) (float64 $workers.gpusPerWorker) -}}
{{- fail (printf "generator.gpusPerReplica (%v) exceeds workers.gpusPerWorker (%v): no pod could hold a replica" $gen.gpusPerReplica $workers.gpusPerWorker) -}}
{{- end -}}
{{- $perWorker := floor (divf (float64 $workers.gpusPerWorker) (float64 $gen.gpusPerReplica)) -}}
{{- $maxGen := int (include "folio.generatorMaxReplicas" .) -}}
{{- if gt (float64 $maxGen) (mulf $perWorker (float64 $workers.maxReplicas)) -}}
{{- fail (printf "workers.maxReplicas (%v pods of %v GPUs) cannot hold %v generator replicas of %v GPUs" $workers.maxReplicas $workers.gpusPerWorker $maxGen $gen.gpusPerReplica) -}}
{{- end -}}
{{- /* The host tier is pinned memory of every replica on a pod, beside /dev/shm: checked where both sizes are in Gi. */ -}}
{{- $hostGiB := .Values.cache.hostCacheGiB -}}
{{- $memory := toString (dig "limits" "memory" "" $workers.resources) -}}
{{- if and (ne $hostGiB nil) (regexMatch "^[0-9]+Gi$" $memory) (regexMatch "^[0-9]+Gi$" (toString $workers.shmSize)) -}}
{{- $needGiB := addf (mulf $perWorker $hostGiB) (float64 (trimSuffix "Gi" (toString $workers.shmSize))) -}}
{{- if gt $needGiB (float64 (trimSuffix "Gi" $memory)) -}}
{{- fail (printf "cache.hostCacheGiB: %v generator replicas per worker pod x %v GiB of pinned host memory plus workers.shmSize (%v) exceed workers.resources.limits.memory (%v)" $perWorker $hostGiB $workers.shmSize $memory) -}}
{{- end -}}
{{- end -}}
{{- if and (ne .Values.cache.tokens nil) (ne (mod (int .Values.cache.tokens) (int .Values.cache.pageSize)) 0) -}}
{{- fail (printf "cache.tokens (%v) must be a multiple of cache.pageSize (%v)" .Values.cache.tokens .Values.cache.pageSize) -}}
{{- end -}}
{{- $ports := list .Values.ports.grpc .Values.ports.http .Values.ports.dashboard .Values.ports.gcs .Values.ports.client -}}
{{- if ne (len (uniq $ports)) (len $ports) -}}
{{- fail (printf "ports: must all differ, got %v" $ports) -}}
{{- end -}}
{{- end -}}

{{/* folio.serve.app.ROUTER_CLASSES */}}
{{- define "folio.routerClass" -}}
{{- $classes := dict
    "prefix" "folio.router.ray_router:PrefixAwareRequestRouter"
    "pow2" "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
    "ray_prefix" "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter" -}}
{{- get $classes .Values.router.name -}}
{{- end -}}

{{/* folio.serve.app.request_router_config's kwargs, as JSON: router.options over the router's defaults (prefix: prompts
are hashed with the cache's page size until replicas report theirs; ray_prefix: an explicit imbalance threshold). */}}
{{- define "folio.routerKwargs" -}}
{{- $defaults := dict -}}
{{- if eq .Values.router.name "prefix" -}}
{{- $defaults = dict "default_page_size" (int .Values.cache.pageSize) -}}
{{- else if eq .Values.router.name "ray_prefix" -}}
{{- $defaults = dict "imbalanced_threshold" 10 -}}
{{- end -}}
{{- merge (deepCopy .Values.router.options) $defaults | toJson -}}
{{- end -}}

{{/*
The Serve config (deploy/serve.yaml's structure): the application built by folio.serve.app:build_app from ServeConfig
args, with the deployments' settings that the code does not know (autoscaling, the router, the ingress's capacity).
Strings and fractions go through toJson (JSON scalars are YAML, quoted where they must be); integers through
int: Helm holds numbers as float64, which toJson would print as 1e+06.
*/}}
{{- define "folio.serveConfig" -}}
{{- $gen := .Values.generator -}}
{{- $auto := $gen.autoscaling -}}
{{- $maxOngoing := add $gen.maxBatchSize $gen.maxQueueSize -}}
{{- $maxGen := int (include "folio.generatorMaxReplicas" .) -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.ports.http | int }}
grpc_options:
  port: {{ .Values.ports.grpc | int }}
  grpc_servicer_functions:
    - folio.serve.grpc_servicer.add_GenerationServicer_to_server
  {{- if ne .Values.serve.requestTimeoutS nil }}
  request_timeout_s: {{ .Values.serve.requestTimeoutS | toJson }}
  {{- end }}
applications:
  - name: {{ .Values.serve.appName | toJson }}
    route_prefix: {{ printf "/%s" .Values.serve.appName | toJson }}
    import_path: folio.serve.app:build_app
    args:
      model_path: {{ .Values.model.path | toJson }}
      {{- if ne .Values.model.dtype nil }}
      dtype: {{ .Values.model.dtype | toJson }}
      {{- end }}
      {{- if ne .Values.model.maxSeqLen nil }}
      max_seq_len: {{ .Values.model.maxSeqLen | int }}
      {{- end }}
      {{- if .Values.model.draftPath }}
      draft_model_path: {{ .Values.model.draftPath | toJson }}
      {{- end }}
      {{- if .Values.model.ngram }}
      ngram: true
      {{- end }}
      num_draft_tokens: {{ .Values.model.numDraftTokens | default 4 | int }}
      {{- with .Values.model.loraAdapters }}
      lora_adapters: {{ toJson . }}
      {{- end }}
      {{- if .Values.model.loraAdmin }}
      lora_admin: true
      {{- end }}
      max_loras: {{ .Values.model.maxLoras | default 8 | int }}
      max_lora_rank: {{ .Values.model.maxLoraRank | default 16 | int }}
      {{- if ne .Values.cache.tokens nil }}
      cache_tokens: {{ .Values.cache.tokens | int }}
      {{- else if ne .Values.cache.memoryFraction nil }}
      cache_memory_fraction: {{ .Values.cache.memoryFraction | toJson }}
      {{- end }}
      page_size: {{ .Values.cache.pageSize | int }}
      {{- if ne .Values.model.weightFormat nil }}
      weight_format: {{ .Values.model.weightFormat | toJson }}
      {{- end }}
      {{- if ne .Values.cache.kvFormat nil }}
      kv_format: {{ .Values.cache.kvFormat | toJson }}
      {{- end }}
      {{- if ne .Values.cache.hostCacheGiB nil }}
      host_cache_bytes: {{ mulf .Values.cache.hostCacheGiB 1073741824 | int64 }}
      {{- end }}
      {{- if .Values.cache.hostWriteThrough }}
      host_write_through: true
      {{- end }}
      max_batch_size: {{ $gen.maxBatchSize | int }}
      max_queue_size: {{ $gen.maxQueueSize | int }}
      max_stream_messages_per_s: {{ $gen.streamMessagesPerS | float64 }}
      token_channel: {{ $gen.tokenChannel }}
      ingress_mode: {{ .Values.serve.ingressMode | toJson }}
      {{- if ne $gen.maxQueuedRequests nil }}
      max_queued_requests: {{ $gen.maxQueuedRequests | int }}
      {{- end }}
      {{- if $auto.enabled }}
      # The ingress admits what the generators take at the most replicas (build_app knows only num_replicas).
      admission_limit: {{ mul $maxGen $maxOngoing }}
      {{- end }}
      num_replicas: {{ $gen.replicas | int }}
      num_gpus: {{ $gen.gpusPerReplica | toJson }}
      num_cpus: {{ $gen.cpusPerReplica | toJson }}
      tensor_parallel_size: {{ default 1 $gen.tensorParallelSize | int }}
      {{- if and $gen.tensorParallelAllReduce (ne $gen.tensorParallelAllReduce "auto") }}
      tensor_parallel_all_reduce: {{ $gen.tensorParallelAllReduce }}
      {{- end }}
      ingress_replicas: {{ .Values.ingress.replicas | int }}
      ingress_num_cpus: {{ .Values.ingress.cpusPerReplica | toJson }}
      grpc_port: {{ .Values.ports.grpc | int }}
      http_port: {{ .Values.ports.http | int }}
      http_host: 0.0.0.0
      app_name: {{ .Values.serve.appName | toJson }}
      graceful_shutdown_timeout_s: {{ $gen.gracefulShutdownTimeoutS | toJson }}
      router: {{ .Values.router.name | toJson }}
      {{- with .Values.router.options }}
      router_options: {{ toJson . }}
      {{- end }}
      routing_stats_period_s: {{ .Values.router.statsPeriodS | toJson }}
      routing_stats_timeout_s: {{ .Values.router.statsTimeoutS | toJson }}
      {{- if ne .Values.serve.requestTimeoutS nil }}
      request_timeout_s: {{ .Values.serve.requestTimeoutS | toJson }}
      {{- end }}
    deployments:
      - name: Generator
        {{- if $auto.enabled }}
        num_replicas: auto
        autoscaling_config:
          min_replicas: {{ $auto.minReplicas | int }}
          initial_replicas: {{ default $auto.minReplicas $auto.initialReplicas | int }}
          max_replicas: {{ $auto.maxReplicas | int }}
          target_ongoing_requests: {{ $auto.targetOngoingRequests | toJson }}
          upscale_delay_s: {{ $auto.upscaleDelayS | toJson }}
          downscale_delay_s: {{ $auto.downscaleDelayS | toJson }}
        {{- else }}
        num_replicas: {{ $gen.replicas | int }}
        {{- end }}
        max_ongoing_requests: {{ $maxOngoing }}
        ray_actor_options:
          num_gpus: {{ $gen.gpusPerReplica | toJson }}
          num_cpus: {{ $gen.cpusPerReplica | toJson }}
        # = folio.serve.app.request_router_config(args), so that the head imports the router class when it validates
        # this config (tests/test_deploy.py checks the two agree).
        request_router_config:
          request_router_class: {{ include "folio.routerClass" . | toJson }}
          request_router_kwargs: {{ include "folio.routerKwargs" . }}
          request_routing_stats_period_s: {{ .Values.router.statsPeriodS | toJson }}
          request_routing_stats_timeout_s: {{ .Values.router.statsTimeoutS | toJson }}
{{- end -}}

{{/* The environment every Ray pod starts with for serve.ingressMode (folio.serve.ingress_mode.DIRECT_ENV). */}}
{{- define "folio.ingressEnv" -}}
{{- if eq .Values.serve.ingressMode "direct" }}
- {name: RAY_SERVE_THROUGHPUT_OPTIMIZED, value: "1"}
- {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
{{- end }}
{{- end -}}
