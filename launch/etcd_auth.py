"""etcd's users and roles for the routers: only they may read or write the routers' keys.

etcd with ``--client-cert-auth`` and authentication on takes the common name of a
client's certificate as its user name; a certificate whose name is no user's is
refused. So every router gets a user named as its certificate's CN
(``<site>/router/<name>``, :attr:`Identity.path`) with the role
:data:`ROUTER_ROLE`, which may read and write every key under ``etcd.prefix`` and
nothing else; then authentication is turned on. Any other certificate of the
cluster CA (a worker's, a tenant's, an operator's) is refused every call: it can
neither drain workers, hide routers, forge quota figures nor publish workers. The
``root`` user etcd requires before authentication is turned on gets a random
password that is not kept: nobody holds it afterwards (a deployment's users change
with a new etcd, as `kvrelay serve` makes one each run).

Etcd clusters kvrelay does not start (the Helm chart's ``etcd.endpoints``) get the
same with :func:`router_commands`' etcdctl lines, run once by their operator."""

from __future__ import annotations

import secrets

from kvrelay.runtime.etcd import EtcdClient, prefix_end
from kvrelay.runtime.pki import Identity
from kvrelay.v1 import etcd_pb2 as epb

ROUTER_ROLE = "kvrelay-router"
"""The role of the routers' users: read and write under ``etcd.prefix``."""


async def secure(client: EtcdClient, prefix: str, routers: list[Identity]) -> None:
    """Gives each of ``routers`` a user of :data:`ROUTER_ROLE` (read and write under ``prefix``), then
    turns authentication on (EtcdError naming the step etcd refused). ``client`` must be able to
    manage users: etcd before authentication is on, as every fresh cluster is."""
    await client.auth("RoleAdd", epb.AuthRoleAddRequest(name=ROUTER_ROLE))
    perm = epb.Permission(permType=epb.Permission.READWRITE, key=prefix.encode(), range_end=prefix_end(prefix))
    await client.auth("RoleGrantPermission", epb.AuthRoleGrantPermissionRequest(name=ROUTER_ROLE, perm=perm))
    for ident in routers:
        await client.auth("UserAdd", epb.AuthUserAddRequest(name=ident.path,
                                                            options=epb.UserAddOptions(no_password=True)))
        await client.auth("UserGrantRole", epb.AuthUserGrantRoleRequest(user=ident.path, role=ROUTER_ROLE))
    await client.auth("UserAdd", epb.AuthUserAddRequest(name="root", password=secrets.token_urlsafe(32)))
    await client.auth("UserGrantRole", epb.AuthUserGrantRoleRequest(user="root", role="root"))
    await client.auth("AuthEnable", epb.AuthEnableRequest())


def router_commands(prefix: str, routers: list[Identity]) -> list[str]:
    """The etcdctl (3.4+) commands that do what :func:`secure` does, for an etcd kvrelay does not start."""
    out = [f"etcdctl role add {ROUTER_ROLE}",
           f"etcdctl role grant-permission {ROUTER_ROLE} --prefix=true readwrite '{prefix}'"]
    for ident in routers:
        out += [f"etcdctl user add '{ident.path}' --no-password",
                f"etcdctl user grant-role '{ident.path}' {ROUTER_ROLE}"]
    return [*out, "etcdctl user add root  # a password of your own, kept by you", "etcdctl user grant-role root root",
            "etcdctl auth enable"]
