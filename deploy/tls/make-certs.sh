#!/bin/sh
# Makes the TLS material of a shardps job with openssl: a private CA, one
# certificate for the daemons and clients (usable for both sides of mutual
# TLS), and a random bearer token.
#   deploy/tls/make-certs.sh DIR [NAME...]
# writes DIR/ca.crt, ca.key, tls.crt, tls.key and token. The certificate
# names localhost, 127.0.0.1 and every NAME (DNS names, or IP addresses as
# IP:10.0.0.5): list the hosts that clients dial, e.g. coordinator server-0
# server-1, or '*.shardps-server.shardps.svc.cluster.local'. An existing CA
# in DIR is reused, so certificates made later trust each other.
# Then: daemons and clients --tls_cert=DIR/tls.crt --tls_key=DIR/tls.key
# --tls_ca=DIR/ca.crt --auth_token_file=DIR/token.
set -eu

if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [NAME...]" >&2
  exit 1
fi
dir=$1
shift
mkdir -p "$dir"
umask 077

san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  case $name in
    IP:*) san="$san,$name" ;;
    *) san="$san,DNS:$name" ;;
  esac
done

cat >"$dir/ca.cnf" <<CNF
[req]
distinguished_name = dn
x509_extensions = ca
prompt = no
[dn]
CN = shardps CA
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
CNF
cat >"$dir/leaf.cnf" <<CNF
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = $san
authorityKeyIdentifier = keyid
CNF

if [ ! -f "$dir/ca.key" ] || [ ! -f "$dir/ca.crt" ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days 3650 \
    -config "$dir/ca.cnf" 2>/dev/null
fi
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$dir/tls.key" -out "$dir/tls.csr" -subj "/CN=shardps" 2>/dev/null
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days 825 \
  -extfile "$dir/leaf.cnf" -out "$dir/tls.crt" 2>/dev/null
if [ ! -f "$dir/token" ]; then
  openssl rand -hex 32 >"$dir/token"
fi
rm -f "$dir/tls.csr" "$dir/ca.cnf" "$dir/leaf.cnf"
chmod 644 "$dir/ca.crt" "$dir/tls.crt"
echo "$dir: ca.crt tls.crt tls.key token ($san)"
