// A real OpenID Connect provider (the npm package oidc-provider, OpenID Certified) on loopback,
// for tests/integration/test_oidc.py. Usage: node provider.mjs CONFIG.json
// CONFIG: {"port": N, "issuer": "http://127.0.0.1:N", "jwks": {"keys": [private JWKs]},
//          "clients": [{"client_id", "client_secret", "groups": [...], "ttl_s": N}]}
// Access tokens are JWTs (RS256 or what a key's alg says) for the resource asked (default
// urn:kvrelay), carrying the client's "groups". Prints "READY <issuer>" once it listens.
import fs from 'node:fs';
import Provider from 'oidc-provider';

const cfg = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const byId = Object.fromEntries(cfg.clients.map((c) => [c.client_id, c]));

const provider = new Provider(cfg.issuer, {
  jwks: cfg.jwks,
  cookies: { keys: [cfg.cookie_key || 'kvrelay-test-provider-cookie-key'] },
  clients: cfg.clients.map((c) => ({
    client_id: c.client_id,
    client_secret: c.client_secret,
    grant_types: ['client_credentials'],
    redirect_uris: [],
    response_types: [],
  })),
  features: {
    devInteractions: { enabled: false },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => 'urn:kvrelay',
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resource, client) => ({
        scope: 'api',
        audience: resource,
        accessTokenTTL: byId[client.clientId].ttl_s || 600,
        accessTokenFormat: 'jwt',
        jwt: { sign: { alg: cfg.alg || 'RS256' } },
      }),
    },
  },
  extraTokenClaims: (ctx, token) => ({ groups: byId[token.clientId]?.groups || [] }),
});
provider.on('server_error', (ctx, err) => console.error('server_error', err));
const server = provider.listen(cfg.port, '127.0.0.1', () => {
  console.log(`READY ${cfg.issuer}`);
});
process.on('SIGTERM', () => server.close(() => process.exit(0)));
