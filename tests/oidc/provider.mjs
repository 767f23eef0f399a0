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
  clients: [...cfg.clients.map((c) => ({
    client_id: c.client_id,
    client_secret: c.client_secret,
    grant_types: ['client_credentials'],
    redirect_uris: [],
    response_types: [],
  })), {
    // `kvrelay login`: a public client of the device authorization grant, with refresh tokens
    client_id: 'kvrelay-cli',
    token_endpoint_auth_method: 'none',
    grant_types: ['urn:ietf:params:oauth:grant-type:device_code', 'refresh_token'],
    redirect_uris: [],
    response_types: [],
  }],
  scopes: ['openid', 'offline_access', 'api'],
  issueRefreshToken: async (ctx, client, code) => client.grantTypeAllowed('refresh_token'),
  findAccount: async (ctx, id) => ({ accountId: id, claims: async () => ({ sub: id }) }),
  loadExistingGrant: async (ctx) => {
    // the test's users consent to everything (no consent screen): one grant with every scope and the API
    const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope('openid offline_access api');
    grant.addResourceScope('urn:kvrelay', 'api');
    await grant.save();
    return grant;
  },
  features: {
    devInteractions: { enabled: true }, // a login form that takes any name (the test's users)
    deviceFlow: { enabled: true },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => 'urn:kvrelay',
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resource, client) => ({
        scope: 'api',
        audience: resource,
        accessTokenTTL: (byId[client.clientId] || { ttl_s: cfg.cli_ttl_s }).ttl_s || 600,
        accessTokenFormat: 'jwt',
        jwt: { sign: { alg: cfg.alg || 'RS256' } },
      }),
    },
  },
  extraTokenClaims: (ctx, token) => ({
    groups: token.accountId ? (cfg.users || {})[token.accountId] || [] : byId[token.clientId]?.groups || [],
  }),
});
provider.on('server_error', (ctx, err) => console.error('server_error', err));
const server = provider.listen(cfg.port, '127.0.0.1', () => {
  console.log(`READY ${cfg.issuer}`);
});
process.on('SIGTERM', () => server.close(() => process.exit(0)));
