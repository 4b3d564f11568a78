# Sums kvtier's "KV Transfer metrics" log lines (hits, hit_tokens, bytes_loaded) between idle
# engine log lines, one row per round: python3 restores_per_round.py server-kvtier.log
import re,sys
for path in sys.argv[1:]:
    rounds=[]; cur=None
    for line in open(path):
        if 'loggers.py' in line:
            idle='Running: 0 reqs, Waiting: 0 reqs' in line and 'Avg prompt throughput: 0.0' in line
            if idle:
                if cur and cur['hits']: rounds.append(cur)
                cur=None
            continue
        if 'KV Transfer metrics' in line:
            if cur is None: cur={'hits':0,'hit_tokens':0,'bytes_loaded':0,'t':line.split('INFO ')[1][:14]}
            for k in ('hits','hit_tokens','bytes_loaded'):
                m=re.search(r'\b%s=(\d+)'%k,line)
                if m: cur[k]+=int(m.group(1))
    if cur and cur['hits']: rounds.append(cur)
    print(path)
    for r in rounds: print(' ',r['t'],'hits',r['hits'],'tokens',r['hit_tokens'],'GB %.1f'%(r['bytes_loaded']/1e9))
