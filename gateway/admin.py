"""``dflash.v1.GatewayAdmin``: register, retire and weigh drafter versions at run time."""

from __future__ import annotations

import grpc

from dflash.core.sampling import InvalidParam
from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.registry import DrafterEntry, DrafterRegistry, NotAllowed


def entry_to_proto(e: DrafterEntry, is_default: bool) -> gateway_pb2.DrafterEntry:
    return gateway_pb2.DrafterEntry(name=e.name, version=e.version, address=e.address,
                                    is_default=is_default, weight=e.weight)


def list_proto(registry: DrafterRegistry) -> gateway_pb2.ListDraftersResponse:
    return gateway_pb2.ListDraftersResponse(
        drafters=[entry_to_proto(e, d) for e, d in registry.entries()])


class GatewayAdminServicer(gateway_pb2_grpc.GatewayAdminServicer):
    """Args: the registry and a ``register(address, name, version, weight, default)`` callable
    that checks the drafter with the verifier (raises grpc.RpcError, or NotAllowed for an
    address outside ``--drafter-allow``: PERMISSION_DENIED naming ``address``) and registers it.

    Served only on the gateway's admin server (``--admin-bind``), never on the client port."""

    def __init__(self, registry: DrafterRegistry, register):
        self.registry = registry
        self.register = register

    def _is_default(self, label: str) -> bool:
        return any(d for e, d in self.registry.entries() if e.label == label)

    def RegisterDrafter(self, request, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: required")
        if request.weight < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "weight: must be >= 0")
        try:
            e = self.register(request.address, name=request.name or None,
                              version=request.version or None, weight=request.weight,
                              default=request.make_default)
        except NotAllowed as err:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        except grpc.RpcError as err:
            context.abort(err.code(), err.details())
        return entry_to_proto(e, self._is_default(e.label))

    def DeregisterDrafter(self, request, context):
        if not request.drafter:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drafter: required (name@version)")
        try:
            e = self.registry.deregister(request.drafter)
        except InvalidParam as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        return entry_to_proto(e, False)

    def SetDefaultDrafter(self, request, context):
        if not request.drafter:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drafter: required (name@version)")
        try:
            e = self.registry.set_default(request.drafter)
        except InvalidParam as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        return entry_to_proto(e, True)

    def SetDrafterWeights(self, request, context):
        try:
            self.registry.set_weights(dict(request.weights))
        except InvalidParam as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return list_proto(self.registry)

    def ListDrafters(self, request, context):
        return list_proto(self.registry)
