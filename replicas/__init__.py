"""Ray Serve deployments around folio's engine: the generator replica, the gRPC ingress, the app builder, clients.

    folio.serve.config     ServeConfig: the one frozen configuration (YAML / dict / CLI flags), validated at the edge
    folio.serve.app        build_app(args) for `serve run` / `serve build`, and build_application(config)
    folio.serve.generator  Generator deployment: one DynamicGeneratorAsync per replica
    folio.serve.ingress    Ingress deployment: the gRPC servicer behind Ray Serve's gRPC proxy (and a Python API)
    folio.serve.client     Client: Python callers in the cluster, over Ray handles
    folio.serve.grpc_client  a small gRPC client (the `folio generate` command uses it)
    folio.serve.cli        the `folio` command (serve, generate; everything else is folio.cli's)

    folio.serve.connect()  a Client of the `folio serve` running on this machine (folio.serve.client.connect)

Protobuf types stop at the ingress: below it requests and results are the dataclasses of folio.serve.schema.
Submodules are not imported here, so `import folio.serve.config` never loads Ray or torch.
"""


def connect(app_name=None):
    """folio.serve.client.connect: a Client of the `folio serve` running on this machine (imports Ray when called,
    not when folio.serve is)."""
    from folio.serve.client import connect as _connect

    return _connect(app_name)
