"""Ray Serve deployments around folio's engine: the generator replica, the gRPC ingress, the app builder, clients.

    replicas.config     ServeConfig: the one frozen configuration (YAML / dict / CLI flags), validated at the edge
    replicas.app        build_app(args) for `serve run` / `serve build`, and build_application(config)
    replicas.generator  Generator deployment: one DynamicGeneratorAsync per replica
    replicas.ingress    Ingress deployment: the gRPC servicer behind Ray Serve's gRPC proxy (and a Python API)
    replicas.client     Client: Python callers in the cluster, over Ray handles
    replicas.grpc_client  a small gRPC client (the `folio generate` command uses it)
    replicas.cli        the `folio` command (serve, generate; everything else is folio.cli's)

Protobuf types stop at the ingress: below it requests and results are the dataclasses of replicas.schema.
Submodules are not imported here, so `import replicas.config` never loads Ray or torch.
"""
