import json,sys,statistics
def load(f):
    d=json.load(open(f)); out={}
    for r in d['results']:
        if r.get('kind')!='transfer': continue
        k=r['kvferry'][0]; out[r['preset']]=(100*k['vs_limit'], k['median_us'], r['baselines']['limit']['median_us'], k['path']['name'], k['path'].get('param_launches'))
    return out
def table(prev_files,new_files):
    P=[load(f) for f in prev_files]; N=[load(f) for f in new_files]
    print('| preset | before (%d runs) | after (%d runs) | mean change | kvferry µs before / after (median of runs) |'%(len(P),len(N)))
    print('|---|---:|---:|---:|---:|')
    ch=[]
    for p in P[0]:
        a=[x[p][0] for x in P]; b=[x[p][0] for x in N]
        c=statistics.mean(b)-statistics.mean(a); ch.append(c)
        print('| %s | %s | %s | %+.2f | %.2f / %.2f |'%(p,' / '.join('%.1f'%v for v in a),' / '.join('%.1f'%v for v in b),c,statistics.median([x[p][1] for x in P]),statistics.median([x[p][1] for x in N])))
    print('mean %+.2f, up on %d of %d'%(statistics.mean(ch),sum(c>0 for c in ch),len(ch)))
table(sys.argv[1].split(','),sys.argv[2].split(','))
